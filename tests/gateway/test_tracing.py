"""One trace per request: span tree, GenAI attributes, propagation, and OTLP/HTTP export."""

import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from tests.support.servers.loopback import GatewayServer

KEY = "sk-trace-0123456789"
CONFIG = """
auth:
  keys: [{name: tracer-team, key_env: TRACE_TEST_KEY}]
models:
  - name: flaky
    policy: round_robin
    deployments:
      - {name: bad, backend: echo, settings: {fail_after_tokens: 0}}
      - {name: good, backend: echo}
"""
PARENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{PARENT_TRACE}-00f067aa0ba902b7-01"
SECRET_PROMPT = "confidential words here"


@pytest.fixture()
def traced(monkeypatch):
    monkeypatch.setenv("TRACE_TEST_KEY", KEY)
    exporter = InMemorySpanExporter()
    with GatewayServer(CONFIG, span_exporter=exporter) as gw:
        seen = []
        for name in ("bad", "good"):
            backend = gw.backend(name)
            original = backend.generate
            backend.generate = lambda request, original=original: (seen.append(request.trace_context), original(request))[1]
        yield gw, exporter, seen


def post(gw, **extra_headers):
    headers = {"authorization": f"Bearer {KEY}", **extra_headers}
    body = {"model": "flaky", "messages": [{"role": "user", "content": SECRET_PROMPT}], "max_tokens": 2, "seed": 3}
    return httpx.post(gw.base_url + "/v1/chat/completions", json=body, headers=headers, timeout=10)


def test_span_tree_of_a_request_with_a_failover(traced):
    gw, exporter, seen = traced
    assert post(gw, traceparent=TRACEPARENT).status_code == 200
    spans = exporter.get_finished_spans()
    [root] = [s for s in spans if s.kind == SpanKind.SERVER]
    assert root.name == "chat flaky"
    assert format(root.context.trace_id, "032x") == PARENT_TRACE  # the incoming trace continues
    assert all(s.context.trace_id == root.context.trace_id for s in spans)
    attrs = root.attributes
    assert attrs["gen_ai.operation.name"] == "chat"
    assert attrs["url.path"] == "/v1/chat/completions" and attrs["http.request.method"] == "POST"
    assert attrs["gen_ai.provider.name"] == "kvgate"
    assert attrs["gen_ai.request.model"] == "flaky"
    assert attrs["gen_ai.request.max_tokens"] == 2 and attrs["gen_ai.request.seed"] == 3
    assert attrs["gen_ai.usage.input_tokens"] == 3 and attrs["gen_ai.usage.output_tokens"] == 2
    assert list(attrs["gen_ai.response.finish_reasons"]) == ["length"]
    assert attrs["http.response.status_code"] == 200
    assert attrs["kvgate.api_key.name"] == "tracer-team"

    attempts = sorted((s for s in spans if s.kind == SpanKind.CLIENT), key=lambda s: s.attributes["kvgate.attempt"])
    assert [a.attributes["kvgate.deployment"] for a in attempts] == ["bad", "good"]
    assert attempts[0].status.status_code == StatusCode.ERROR
    assert attempts[0].attributes["error.type"] == "upstream_error"
    assert attempts[1].status.status_code != StatusCode.ERROR
    assert all(a.parent.span_id == root.context.span_id for a in attempts)

    routes = [s for s in spans if s.name == "kvgate.route"]
    assert [r.attributes["kvgate.deployment"] for r in routes] == ["bad", "good"]
    assert routes[0].attributes["kvgate.policy"] == "round_robin"
    assert list(routes[0].attributes["kvgate.candidates"]) == ["bad", "good"]

    # the backend's own milestones become backdated phase spans under the attempt that served it
    phases = {s.name: s for s in spans if s.name.startswith("engine.")}
    assert set(phases) == {"engine.queued", "engine.prefill", "engine.decode"}
    assert all(p.parent.span_id == attempts[1].context.span_id for p in phases.values())
    assert phases["engine.prefill"].attributes["kvgate.engine.prefill_chunks"] == 1
    assert phases["engine.prefill"].end_time <= phases["engine.decode"].start_time + 1000

    # each attempt's own span is the parent the backend was given
    sent = [tc["traceparent"].split("-")[2] for tc in seen]
    assert sent == [format(a.context.span_id, "016x") for a in attempts]


def test_no_secret_and_no_prompt_text_in_any_span(traced):
    gw, exporter, _ = traced
    post(gw)
    for span in exporter.get_finished_spans():
        for value in span.attributes.values():
            text = str(value)
            assert KEY not in text and SECRET_PROMPT not in text and "confidential" not in text


def test_unsampled_parent_exports_nothing(traced):
    gw, exporter, _ = traced
    post(gw, traceparent=f"00-{PARENT_TRACE}-00f067aa0ba902b7-00")
    assert exporter.get_finished_spans() == ()


def test_errors_mark_the_root_span(traced):
    gw, exporter, _ = traced
    r = httpx.post(gw.base_url + "/v1/chat/completions", headers={"authorization": f"Bearer {KEY}"},
                   json={"model": "flaky", "messages": [{"role": "user", "content": "w " * 5000}]}, timeout=10)
    assert r.status_code == 400
    [root] = [s for s in exporter.get_finished_spans() if s.kind == SpanKind.SERVER]
    assert root.status.status_code == StatusCode.ERROR
    assert root.attributes["http.response.status_code"] == 400


class _Collector(BaseHTTPRequestHandler):
    received: list = []

    def do_POST(self):
        body = self.rfile.read(int(self.headers["content-length"]))
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        _Collector.received.append((self.path, dict(self.headers), request))
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args):
        pass


def test_otlp_http_export_to_a_loopback_collector(monkeypatch):
    monkeypatch.setenv("TRACE_TEST_KEY", KEY)
    collector = HTTPServer(("127.0.0.1", 0), _Collector)
    threading.Thread(target=collector.serve_forever, daemon=True).start()
    port = collector.server_address[1]
    config = CONFIG + f"""
telemetry:
  tracing:
    exporter: otlp_http
    endpoint: http://127.0.0.1:{port}/v1/traces
    headers: {{x-collector-token: abc}}
"""
    _Collector.received.clear()
    try:
        with GatewayServer(config) as gw:
            assert post(gw, traceparent=TRACEPARENT).status_code == 200
        # closing the gateway flushed the batch processor
        assert _Collector.received
        path, headers, request = _Collector.received[0]
        assert path == "/v1/traces"
        assert headers.get("x-collector-token") == "abc"
        spans = [s for rs in request.resource_spans for ss in rs.scope_spans for s in ss.spans]
        names = {s.name for s in spans}
        assert {"chat flaky", "kvgate.route"} <= names
        assert {s.trace_id.hex() for s in spans} == {PARENT_TRACE}
        service = {a.key: a.value.string_value for a in request.resource_spans[0].resource.attributes}
        assert service["service.name"] == "kvgate"
    finally:
        collector.shutdown()
