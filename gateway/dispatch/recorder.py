"""Closes the books on one request: metrics, trace spans, key limits and observer hooks.

One recorder per request. Its per-token method is the only part on the hot path: a clock read
and one histogram step per list of tokens that arrived together; spans are touched only when
tracing is on.
"""

from __future__ import annotations

import time
from itertools import repeat

from gateway.backend import TokenEvent
from gateway.observability.metrics import observe_times
from gateway.observability.tracing import PROVIDER, RequestTrace
from gateway.plugins import notify
from gateway.state import GatewayState


class RequestRecorder:
    def __init__(self, state: GatewayState, *, key, request_id: str, model: str, sla_class: str, operation: str,
                 headers, path: str, sampling, n: int = 1):
        self.state, self.metrics = state, state.metrics
        self.key, self.request_id, self.model, self.sla_class = key, request_id, model, sla_class
        self.operation = operation
        self.n = n  # choices per prompt: each one reads its prompt (what a key's tokens/min counts)
        self.started = time.monotonic()
        self.first_token_at: float | None = None
        self._last_token: dict[int, float] = {}
        self._itl = None
        self.deployment = ""
        self.done = False
        self.hold = None  # the request's budget reservation (gateway.budgets), settled at finish
        self.cache = None  # (ResponseCache, Lookup) of a request the model's cache looked up
        self.capture = None  # the Lookup that keeps this answer's events (a miss to be stored)
        self.free = False  # a cache hit not charged: 0 tokens to the key's limits and budgets
        self.replayed = False  # a cache hit: its tokens were not generated now, so TTFT and ITL skip them
        self.trace = None
        if state.tracer is not None:
            self.trace = RequestTrace(state.tracer, f"{operation} {model}", headers, _request_attributes(
                operation, model, path, sla_class, key, sampling))

    # ------------------------------------------------------------------ admission and attempts

    def queued(self, seconds: float, waited: bool) -> None:
        self.metrics.series(self.metrics.queue_wait, self.model, self.sla_class).observe(seconds)
        if self.trace is not None and waited:
            start = time.time_ns() - int(seconds * 1e9)
            span = self.trace.child("kvgate.queue", {"kvgate.sla_class": self.sla_class}, start_time=start)
            span.end()

    def shed(self, reason: str) -> None:
        self.metrics.shed.labels(self.model, self.sla_class, reason).inc()

    def routed(self, pool, deployment, scores: dict[str, float] | None, hop: str | None = None) -> None:
        """A routing decision (`hop` "prefill": a disaggregated request's prefill hop, whose
        deployment is not the one that answers the client)."""
        if hop != "prefill":
            self.deployment = deployment.name
        if self.trace is not None:
            attrs = {"kvgate.policy": pool.config.policy, "kvgate.deployment": deployment.name,
                     "kvgate.candidates": list(scores or {}),
                     "kvgate.candidate_scores": [round(s, 4) for s in (scores or {}).values()]}
            if hop is not None:
                attrs["kvgate.pd.hop"] = hop
            policy = pool.prefill_policy if hop == "prefill" and pool.prefill_policy is not None else pool.policy
            tokens = policy.matched_tokens(self.request_id)
            if tokens is not None:  # precise_prefix: the prompt tokens the index says it holds
                attrs["kvgate.kv_prefix_matched_tokens"] = tokens
            self.trace.child("kvgate.route", attrs).end()

    def refused_as_bad(self) -> None:
        """The deployment tried answered that the request itself is bad (a 400 of its own checks:
        a schema keyword its grammar library lacks, a prompt over its context). That is the
        client's mistake, not the deployment's: the answer is counted as the gateway's own
        refusals before routing are, under no deployment."""
        self.deployment = ""

    def attempt(self, deployment, upstream_model: str, number: int):
        """A CLIENT span for one backend attempt, or None; its context travels to the backend."""
        if self.trace is None:
            return None
        return self.trace.child(f"{self.operation} {upstream_model}", {
            "gen_ai.operation.name": self.operation, "gen_ai.provider.name": PROVIDER,
            "gen_ai.request.model": upstream_model, "kvgate.deployment": deployment.name,
            "kvgate.attempt": number}, client=True)

    def attempt_failed(self, span, deployment, error, retried: bool = True) -> None:
        """An attempt failed before its first token (error None: it was cancelled)."""
        if retried:
            self.metrics.retries.labels(self.model, deployment.name).inc()
        if span is not None:
            if error is not None:
                self.trace.fail(span, error.code or type(error).__name__, error.message)
            span.end()

    def attempt_done(self, span, last_event: TokenEvent | None, finished: bool) -> None:
        if last_event is not None:
            if last_event.usage is not None:
                span.set_attribute("gen_ai.usage.input_tokens", last_event.usage.prompt_tokens)
                span.set_attribute("gen_ai.usage.output_tokens", last_event.usage.completion_tokens)
            span.set_attribute("gen_ai.response.finish_reasons", [last_event.finish_reason or ""])
            if last_event.timings:
                _engine_spans(self.trace, span, last_event.timings)
        if not finished:
            span.set_attribute("kvgate.aborted", True)
        span.end()

    def fallback_used(self, fallback_model: str) -> None:
        self.metrics.failovers.labels(self.model, fallback_model).inc()

    # ------------------------------------------------------------------ tokens

    def tokens(self, index: int, events: list[TokenEvent]) -> None:
        """Events of choice `index` that arrived together: the first is timed from the choice's
        last token, the others came with it (inter-token latency 0, observed in one step)."""
        now = time.monotonic()
        if self.hold is not None:
            self.hold.observe(events)
        if self.capture is not None:
            self.capture.tokens(index, events)
        if self.replayed:
            return
        if self.first_token_at is None:
            self.first_token_at = now
            self.metrics.series(self.metrics.ttft, self.model, self.sla_class).observe(now - self.started)
            self.state.recent.ttft.append(now - self.started)
        last = self._last_token.get(index)
        together = len(events) - 1
        if last is not None or together:
            if self._itl is None:  # the labelled series, looked up once per request, not per token
                self._itl = self.metrics.series(self.metrics.itl, self.model)
            tpot = self.state.recent.tpot
            if last is not None:
                self._itl.observe(now - last)
                tpot.append(now - last)
            if together:
                observe_times(self._itl, 0.0, together)
                tpot.extend(repeat(0.0, together))
        self._last_token[index] = now

    # ------------------------------------------------------------------ the end

    def finish(self, status, usage: dict | None, finish_reasons=(), error: str | None = None) -> None:
        if self.done:
            return
        self.done = True
        self.state.recent.finished(self.model, status, error, self.key.name if self.key is not None else None)
        m = self.metrics
        m.requests.labels(self.model, self.deployment, self.sla_class, str(status)).inc()
        if status == 200:
            m.series(m.e2e, self.model, self.sla_class).observe(time.monotonic() - self.started)
        if usage:
            m.series(m.prompt_tokens, self.model).observe(usage.get("prompt_tokens", 0))
            m.series(m.completion_tokens, self.model).observe(usage.get("completion_tokens", 0))
        if status == 429 and self.key is not None:
            m.rate_limited.labels(self.key.name).inc()
        if self.key is not None:
            self.state.limiter.finish(self.key, 0 if self.free else _key_tokens(usage, self.n))
        hit = self.cache is not None and self.cache[1].hit is not None
        if self.hold is not None:
            self.state.budgets.settle(self.hold, usage, status, cache_hit=hit, free=self.free)
        if self.capture is not None:
            self.cache[0].keep(self.capture, status, finish_reasons, error)
        if self.trace is not None:
            self.trace.end(status, _response_attributes(self.request_id, self.model, usage, finish_reasons))
        notify(self.state.pm, "request_finished", request_id=self.request_id, model=self.model,
               status=status, usage=usage)


def _key_tokens(usage: dict | None, n: int) -> int:
    """Tokens charged to a key: every choice's prompt and completion (usage counts a prompt once)."""
    if not usage:
        return 0
    return usage.get("prompt_tokens", 0) * n + usage.get("completion_tokens", 0)


def _request_attributes(operation, model, path, sla_class, key, sampling) -> dict:
    attrs = {
        "http.request.method": "POST", "url.path": path,
        "gen_ai.operation.name": operation, "gen_ai.provider.name": PROVIDER, "gen_ai.request.model": model,
        "kvgate.sla_class": sla_class,
    }
    if key is not None:
        attrs["kvgate.api_key.name"] = key.name
    if sampling is not None:
        if sampling.max_tokens is not None:
            attrs["gen_ai.request.max_tokens"] = sampling.max_tokens
        attrs["gen_ai.request.temperature"] = sampling.temperature
        attrs["gen_ai.request.top_p"] = sampling.top_p
        if sampling.seed is not None:
            attrs["gen_ai.request.seed"] = sampling.seed
    return attrs


def _response_attributes(request_id, model, usage, finish_reasons) -> dict:
    attrs = {"gen_ai.response.id": request_id, "gen_ai.response.model": model}
    if finish_reasons:
        attrs["gen_ai.response.finish_reasons"] = [r for r in finish_reasons if r]
    if usage:
        attrs["gen_ai.usage.input_tokens"] = usage.get("prompt_tokens", 0)
        attrs["gen_ai.usage.output_tokens"] = usage.get("completion_tokens", 0)
    return attrs


ENGINE_PHASES = (("engine.queued", "arrived", "scheduled"), ("engine.prefill", "scheduled", "first_token"),
                 ("engine.decode", "first_token", "finished"),
                 # a decode engine reading the prompt's KV from a prefill engine (its KV connector)
                 ("engine.kv_transfer", "kv_transfer_started", "kv_transfer_ended"))
PHASE_MARKS = frozenset(mark for _, start, end in ENGINE_PHASES for mark in (start, end))


def _engine_spans(trace: RequestTrace, parent, timings: dict[str, float]) -> None:
    """Backdated spans from the engine's own clock readings: where the time went inside it.
    Speculative decoding's counters (`spec_*`: drafts, accepted, acceptance) go on the decode
    span, a KV read's (`kv_transfer_*`: tokens, bytes, failed) on the kv_transfer span, the others
    (prefill chunks, preemptions, cached tokens) on the prefill span."""
    counters = {f"kvgate.engine.{k}": v for k, v in timings.items() if k not in PHASE_MARKS}
    own = {"engine.decode": "kvgate.engine.spec_", "engine.kv_transfer": "kvgate.engine.kv_transfer_"}
    phase_attributes = {name: {k: v for k, v in counters.items() if k.startswith(prefix)} for name, prefix in own.items()}
    phase_attributes["engine.prefill"] = {k: v for k, v in counters.items() if not k.startswith(tuple(own.values()))}
    for name, start_key, end_key in ENGINE_PHASES:
        start, end = timings.get(start_key), timings.get(end_key)
        if start is None or end is None:
            continue
        span = trace.child(name, phase_attributes.get(name), start_time=int(start * 1e9), parent=parent)
        span.end(end_time=int(max(end, start) * 1e9))
