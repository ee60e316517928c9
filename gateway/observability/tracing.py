"""OpenTelemetry traces: one trace per request, from the HTTP request down to the engine.

    chat smollm2 (SERVER, root; incoming traceparent honoured)
    ├── kvgate.queue            admission wait in the pool (SLA class, queued or not)
    ├── kvgate.route            policy, candidates with their load scores, chosen deployment
    ├── chat smollm2 (CLIENT)   one per backend attempt: retries and failovers are visible
    │   └── engine spans        queued, prefill, decode (the native engine reports its timings)
    └── ...

Attribute names follow the OpenTelemetry GenAI semantic conventions where they exist
(`gen_ai.*`, still "Development" upstream); kvgate's own are under `kvgate.*`. The API key's
*name* is recorded, never the key, and never prompt or completion text.

With tracing off (the default) no tracer exists and the hot path only tests `is None`.
Each gateway owns its TracerProvider (not the process-global one, which can be set only once).
"""

from __future__ import annotations

from gateway.config import TracingConfig

PROVIDER = "kvgate"


def make_tracer_provider(config: TracingConfig, exporter=None):
    """This gateway's TracerProvider, or None when tracing is off. `exporter` overrides the
    config (tests pass an in-memory exporter). Call `shutdown()` on it to flush at exit."""
    if exporter is None and config.exporter == "none":
        return None
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    provider = TracerProvider(
        resource=Resource.create({"service.name": config.service_name}),
        sampler=ParentBased(TraceIdRatioBased(config.sample_ratio)),
    )
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    else:
        # Batch in a background thread: a synchronous exporter would block the event loop.
        provider.add_span_processor(BatchSpanProcessor(_exporter(config)))
    return provider


def _exporter(config: TracingConfig):
    if config.exporter == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    if config.exporter == "otlp_http":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint=config.endpoint, headers=config.headers or None)
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter  # optional extra

    return OTLPSpanExporter(endpoint=config.endpoint, headers=tuple((config.headers or {}).items()) or None)


class RequestTrace:
    """The spans of one request. Created only when tracing is on."""

    def __init__(self, tracer, name: str, headers, attributes: dict):
        from opentelemetry import trace
        from opentelemetry.propagate import extract

        self._trace = trace
        self.tracer = tracer
        parent = extract({k: v for k, v in headers.items() if k in ("traceparent", "tracestate")})
        self.root = tracer.start_span(name, context=parent, kind=trace.SpanKind.SERVER, attributes=attributes)
        self.context = trace.set_span_in_context(self.root)

    def child(self, name: str, attributes: dict | None = None, client: bool = False, start_time: int | None = None,
              parent=None):
        kind = self._trace.SpanKind.CLIENT if client else self._trace.SpanKind.INTERNAL
        context = self._trace.set_span_in_context(parent) if parent is not None else self.context
        return self.tracer.start_span(name, context=context, kind=kind, attributes=attributes or {},
                                      start_time=start_time)

    def carrier(self, span) -> dict[str, str]:
        """W3C traceparent/tracestate naming `span` as the parent, for a backend call."""
        from opentelemetry.propagate import inject

        carrier: dict[str, str] = {}
        inject(carrier, context=self._trace.set_span_in_context(span))
        return carrier

    def fail(self, span, error_type: str, message: str) -> None:
        from opentelemetry.trace import Status, StatusCode

        span.set_attribute("error.type", error_type)
        span.set_status(Status(StatusCode.ERROR, message))

    def end(self, status, attributes: dict) -> None:
        self.root.set_attributes(attributes)
        if status != 200:
            self.fail(self.root, str(status), f"answered {status}")
        self.root.set_attribute("http.response.status_code", status if isinstance(status, int) else 200)
        self.root.end()
