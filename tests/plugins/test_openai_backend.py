"""The `openai` backend against real servers on loopback.

(a) kvgate in front of kvgate: a front gateway whose deployment is `backend: openai` pointing at a
    second gateway serving echo; through the real `openai` client the answers must equal echo's.
(b) a purpose-built upstream (Starlette + uvicorn below) that misbehaves on request: chosen
    statuses, stalls, dropped connections, error events, Prometheus pages of each engine.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import openai
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

from gateway.backend import GenerationRequest, SamplingParams
from gateway.errors import (
    BackendError,
    BackendTimeout,
    ContextLengthExceeded,
    InvalidRequestError,
    NotFoundError,
    Overloaded,
    RateLimited,
    RequestTooLarge,
)
from kvgate_openai import make_openai_backend, metrics
from tests.support.servers.loopback import ECHO_GATEWAY, OPENAI_FRONT, AppServer, GatewayServer

PROMPT = "the quick brown fox jumps"
SECRET = "sk-test-5ecret-value-0042"
KEY_ENV = "KVGATE_TEST_UPSTREAM_KEY"


# -- (a) kvgate -> kvgate(echo) ----------------------------------------------------------------

@pytest.fixture(scope="module")
def echo_pair():
    with GatewayServer(ECHO_GATEWAY) as direct, GatewayServer(OPENAI_FRONT.format(base=direct.base_url)) as front:
        yield direct.openai(), front.openai()


CASES = [
    ("completions", dict(prompt=PROMPT, max_tokens=7, seed=2)),
    ("completions", dict(prompt=[11, 22, 33], max_tokens=4)),
    ("completions", dict(prompt=PROMPT, max_tokens=8, stop=["own f"])),
    ("completions", dict(prompt=PROMPT, max_tokens=3, logprobs=1)),
    ("completions", dict(prompt=[PROMPT, "jumps over the dog"], max_tokens=3, n=2, seed=5)),
    ("chat", dict(messages=[{"role": "system", "content": "x"}, {"role": "user", "content": PROMPT}], max_tokens=4)),
    ("chat", dict(messages=[{"role": "user", "content": PROMPT}], max_tokens=3, logprobs=True, top_logprobs=0)),
    ("chat", dict(messages=[{"role": "user", "content": PROMPT}], max_tokens=3, n=3, seed=10)),
    ("chat", dict(messages=[{"role": "user", "content": PROMPT}])),  # the upstream's default length
]


def _call(client, kind, kw, stream):
    api = client.completions if kind == "completions" else client.chat.completions
    if not stream:
        return api.create(model="echo", **kw).model_dump(exclude={"id", "created"})
    chunks = api.create(model="echo", stream=True, stream_options={"include_usage": True}, **kw)
    dumped = [c.model_dump(exclude={"id", "created"}) for c in chunks]
    # Choices of one request interleave in arrival order; within a choice the order is fixed.
    return sorted(dumped, key=lambda c: c["choices"][0]["index"] if c["choices"] else 1 << 30)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("kind,kw", CASES, ids=[f"{k}-{i}" for i, (k, _) in enumerate(CASES)])
def test_through_kvgate_equals_echo_directly(echo_pair, kind, kw, stream):
    direct, front = echo_pair
    assert _call(front, kind, kw, stream) == _call(direct, kind, kw, stream)


@pytest.mark.parametrize("kind,kw", [CASES[0], CASES[4], CASES[5]], ids=["completions", "completions-n2", "chat"])
def test_continuous_usage_through_kvgate_equals_echo_directly(echo_pair, kind, kw):
    """vLLM's usage in every chunk is asked of a kvgate upstream, which counts exactly (prompt
    tokens from the first chunk on), and passed on as it comes."""
    def chunks(client):
        api = client.completions if kind == "completions" else client.chat.completions
        stream = api.create(model="echo", stream=True, **kw,
                            stream_options={"include_usage": True, "continuous_usage_stats": True})
        dumped = [c.model_dump(exclude={"id", "created"}) for c in stream]
        return sorted(dumped, key=lambda c: c["choices"][0]["index"] if c["choices"] else 1 << 30)

    direct, front = echo_pair
    via_front = chunks(front)
    assert all(c["usage"]["prompt_tokens"] > 0 for c in via_front)
    assert via_front == chunks(direct)


def test_upstream_refusal_reaches_the_client_unchanged(echo_pair):
    direct, front = echo_pair
    kw = dict(model="echo", prompt="word " * 100, max_tokens=4000)  # over echo's 4096-word context
    with pytest.raises(openai.BadRequestError) as via_front:
        front.completions.create(**kw)
    with pytest.raises(openai.BadRequestError) as via_direct:
        direct.completions.create(**kw)
    assert via_front.value.code == via_direct.value.code == "context_length_exceeded"
    assert via_front.value.message == via_direct.value.message


# -- (b) a purpose-built upstream ---------------------------------------------------------------

class Upstream:
    """An OpenAI-shaped server whose behaviour is chosen by the prompt (or the last user message)."""

    def __init__(self):
        self.seen_headers: list[dict] = []
        self.seen_bodies: list[dict] = []
        self.disconnected = threading.Event()
        self.metrics_text = ""
        self.metrics_hang = False
        app = Starlette(routes=[
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.completions, methods=["POST"]),
            Route("/metrics", self.metrics),
        ])
        self.app_server = AppServer(app)
        self.base_url = self.app_server.base_url

    def close(self):
        self.app_server.close()

    async def metrics(self, request: Request):
        while self.metrics_hang:
            await asyncio.sleep(0.05)
        if not self.metrics_text:
            return PlainTextResponse("not found", status_code=404)
        return PlainTextResponse(self.metrics_text)

    async def completions(self, request: Request):
        body = await request.json()
        self.seen_headers.append(dict(request.headers))
        self.seen_bodies.append(body)
        script = body["messages"][-1]["content"] if "messages" in body else body["prompt"]
        verb, _, arg = script.partition(":")
        if verb == "status":
            return _error_response(int(arg), request)
        if verb == "vllm400":
            return JSONResponse({"object": "error", "message": "This model's maximum context length is 8 "
                                 "tokens. However, you requested 9 tokens.", "type": "BadRequestError",
                                 "param": None, "code": 400}, status_code=400)
        if verb == "big-answer":  # a non-streamed answer of arg MiB
            text = "x" * (int(arg) * 1024 * 1024)
            return JSONResponse({"choices": [{"index": 0, "text": text, "finish_reason": "stop"}]})
        if verb == "endless-line":
            return StreamingResponse(_endless_line(), media_type="text/event-stream")
        headers = {"set-cookie": "session=for-one-client; Path=/"} if verb == "set-cookie" else None
        return StreamingResponse(self._stream(verb, body), media_type="text/event-stream", headers=headers)

    async def _stream(self, verb: str, body: dict):
        chat = "messages" in body
        try:
            if verb == "stall-first":
                await asyncio.sleep(30)
            for i, word in enumerate(["one", " two", " three"]):
                yield _chunk(chat, word, None)
                if verb == "stall-mid":
                    await asyncio.sleep(30)
                if verb == "drop-mid":
                    raise RuntimeError("upstream dies mid-stream")  # uvicorn drops the connection
                if verb == "error-mid":
                    yield b'data: {"error": {"message": "engine died", "type": "server_error", "code": 500}}\n\n'
                    return
                if verb == "slow":
                    await asyncio.sleep(0.05 if i < 2 else 30)
            yield _chunk(chat, "", "length")
            yield b'data: {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3}}\n\n'
            yield b"data: [DONE]\n\n"
        finally:
            self.disconnected.set()


async def _endless_line():
    """One SSE line that never ends (64 MiB if nobody stops reading)."""
    yield b"data: "
    for _ in range(1024):
        yield b"x" * 65536


def _chunk(chat: bool, text: str, finish) -> bytes:
    choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
    choice["finish_reason"] = finish
    return b"data: " + json.dumps({"object": "chunk", "choices": [choice]}).encode() + b"\n\n"


def _error_response(status: int, request: Request) -> JSONResponse:
    auth = request.headers.get("authorization", "")
    codes = {400: "invalid_value", 404: "model_not_found", 413: "request_too_large", 429: "rate_limit_exceeded",
             503: "server_is_overloaded"}
    # A 401 that echoes the credential back, as some providers do: it must not leak through us.
    message = f"upstream says {status}" if status != 401 else f"Incorrect API key provided: {auth}"
    headers = {"Retry-After": "7"} if status in (429, 503) else {}
    return JSONResponse({"error": {"message": message, "type": "x", "param": None, "code": codes.get(status)}},
                        status_code=status, headers=headers)


@pytest.fixture(scope="module")
def upstream():
    server = Upstream()
    yield server
    server.close()


def _backend(upstream, **settings):
    return make_openai_backend({"base_url": upstream.base_url + "/v1", "metrics": "none", **settings}, "up-0")


def _request(text: str, chat=False, **kw) -> GenerationRequest:
    fields = {"messages": [{"role": "user", "content": text}]} if chat else {"prompt": text}
    return GenerationRequest(request_id=f"r-{text}", model="m", sampling=SamplingParams(max_tokens=3), **fields, **kw)


async def _collect(backend, request):
    return [e async for e in backend.generate(request)]


def run(coro_fn, backend):
    """Start the backend, run `coro_fn(backend)`, stop it; in a fresh event loop."""
    async def main():
        await backend.start()
        try:
            return await coro_fn(backend)
        finally:
            await backend.stop()
    return asyncio.run(main())


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_stream_becomes_token_events_with_usage_on_the_last(upstream, chat):
    events = run(lambda b: _collect(b, _request("ok", chat=chat)), _backend(upstream))
    assert [e.text for e in events] == ["one", " two", " three", ""]
    assert events[-1].finish_reason == "length" and events[-1].usage.completion_tokens == 3
    assert all(e.finish_reason is None for e in events[:-1])


@pytest.mark.parametrize("status,error,code", [
    (400, InvalidRequestError, "invalid_value"),
    (404, NotFoundError, "model_not_found"),
    (413, RequestTooLarge, "request_too_large"),
    (401, BackendError, "upstream_error"),
    (403, BackendError, "upstream_error"),
    (429, RateLimited, "rate_limit_exceeded"),
    (503, Overloaded, "server_is_overloaded"),
    (500, BackendError, "upstream_error"),
])
def test_upstream_status_maps_to_the_gateway_error(upstream, status, error, code):
    with pytest.raises(error) as info:
        run(lambda b: _collect(b, _request(f"status:{status}")), _backend(upstream))
    assert type(info.value) is error and info.value.code == code
    if status in (429, 503):
        assert info.value.headers["Retry-After"] == "7"


def test_vllm_int_code_and_context_message_become_context_length_exceeded(upstream):
    with pytest.raises(ContextLengthExceeded, match="maximum context length is 8"):
        run(lambda b: _collect(b, _request("vllm400")), _backend(upstream))


def test_429_and_503_count_as_load_not_as_a_crash(upstream):
    backend = _backend(upstream, metrics="auto", metrics_url=upstream.base_url + "/nothing")

    async def go(b):
        for _ in range(5):
            with pytest.raises(RateLimited):
                await _collect(b, _request("status:429"))
        return b.load()

    load = run(go, backend)
    assert load.healthy and load.extra["throttled_s"] > 5


def test_no_first_byte_in_time_is_a_timeout_before_the_stream(upstream):
    backend = _backend(upstream, first_byte_s=0.3)
    start = time.monotonic()
    with pytest.raises(BackendTimeout):
        run(lambda b: _collect(b, _request("stall-first")), backend)
    assert time.monotonic() - start < 5


def test_a_request_that_finds_every_connection_taken_is_overloaded_not_a_timeout(upstream):
    """With one connection held by a stalled stream, the next request waits for a connection
    until its first-byte deadline: that is our pool's limit (503, retry), not a slow upstream."""
    async def go(b):
        holder = asyncio.create_task(_collect(b, _request("slow")))  # three tokens, then silence
        await asyncio.sleep(0.3)  # the silent stream holds the only connection
        try:
            with pytest.raises(Overloaded, match="All 1 connections"):
                await _collect(b, _request("waits"))
        finally:
            holder.cancel()
            await asyncio.gather(holder, return_exceptions=True)

    run(go, _backend(upstream, max_connections=1, first_byte_s=1.0))


def test_idle_gap_mid_stream_raises_after_the_first_token(upstream):
    async def go(b):
        events = []
        with pytest.raises(BackendTimeout, match="mid-stream"):
            async for e in b.generate(_request("stall-mid")):
                events.append(e)
        return events

    events = run(go, _backend(upstream, idle_s=0.3))
    assert [e.text for e in events] == ["one"]


def test_dropped_connection_mid_stream_is_a_backend_error(upstream):
    async def go(b):
        events = []
        with pytest.raises(BackendError, match="dropped"):
            async for e in b.generate(_request("drop-mid")):
                events.append(e)
        return events

    assert [e.text for e in run(go, _backend(upstream))] == ["one"]


def test_stream_event_over_the_bound_is_a_backend_error_not_unbounded_memory(upstream):
    async def go(b):
        with pytest.raises(BackendError, match="stream event over 1048576 bytes"):
            await _collect(b, _request("endless-line"))

    run(go, _backend(upstream, max_event_bytes=1024 * 1024))


def test_non_streamed_answer_over_the_bound_is_a_backend_error(upstream):
    request = _request("big-answer:2", stream=False)
    [event] = run(lambda b: _collect(b, request), _backend(upstream, max_body_bytes=3 * 1024 * 1024))
    assert len(event.text) == 2 * 1024 * 1024

    async def go(b):
        with pytest.raises(BackendError, match="answer over 1048576 bytes"):
            await _collect(b, request)

    run(go, _backend(upstream, max_body_bytes=1024 * 1024))


def test_abort_from_another_task_closes_the_upstream_request(upstream):
    upstream.disconnected.clear()

    async def go(b):
        request = _request("slow")  # three tokens, then silence
        events = []

        async def abort_soon():
            await asyncio.sleep(0.3)  # the reader is blocked on the silent upstream by now
            await b.abort(request.request_id)

        aborter = asyncio.create_task(abort_soon())
        async for e in b.generate(request):
            events.append(e)
        await aborter
        return events

    events = run(go, _backend(upstream))
    assert [e.text for e in events[:3]] == ["one", " two", " three"]
    assert events[-1].finish_reason == "abort"
    assert upstream.disconnected.wait(5)


def test_trace_context_is_sent_upstream(upstream):
    trace = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", "tracestate": "k=v",
             "other": "not sent"}
    run(lambda b: _collect(b, _request("ok", trace_context=trace)), _backend(upstream))
    seen = upstream.seen_headers[-1]
    assert seen["traceparent"] == trace["traceparent"] and seen["tracestate"] == "k=v"
    assert "other" not in seen


def test_requests_name_kvgate_and_ask_for_no_compression(upstream, monkeypatch):
    """Plain http goes over h1.py, a proxied URL over aiohttp: both say who sends; h1.py asks
    for no compressed answer (it would not decompress one; aiohttp does)."""
    import gateway

    run(lambda b: _collect(b, _request("ok")), _backend(upstream))
    direct = upstream.seen_headers[-1]
    monkeypatch.setenv("HTTP_PROXY", upstream.base_url)
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    proxied = make_openai_backend({"base_url": "http://upstream.invalid:9/v1", "metrics": "none"}, "up-0")
    run(lambda b: _collect(b, _request("ok")), proxied)
    for seen in (direct, upstream.seen_headers[-1]):
        assert seen["user-agent"] == f"kvgate/{gateway.__version__}"
    assert "accept-encoding" not in direct


def test_a_cookie_one_answer_sets_never_rides_on_another_request(upstream):
    async def go(b):
        await _collect(b, _request("set-cookie"))
        await _collect(b, _request("after"))

    # By name, not by IP address: cookie jars refuse cookies of bare IP addresses anyway.
    by_name = upstream.base_url.replace("127.0.0.1", "localhost")
    run(go, make_openai_backend({"base_url": by_name + "/v1", "metrics": "none"}, "up-0"))
    assert "cookie" not in upstream.seen_headers[-1]


def test_the_environments_proxy_is_used(upstream, monkeypatch):
    """HTTP_PROXY names the way out (looked up once per upstream, not per request): here the
    'proxy' is the upstream itself, and the base_url a name that does not resolve."""
    monkeypatch.setenv("HTTP_PROXY", upstream.base_url)
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    backend = make_openai_backend({"base_url": "http://upstream.invalid:9/v1", "metrics": "none"}, "up-0")
    events = run(lambda b: _collect(b, _request("via-proxy")), backend)
    assert [e.text for e in events][:3] == ["one", " two", " three"]


def test_api_key_is_sent_but_never_logged_or_shown(upstream, monkeypatch, caplog):
    monkeypatch.setenv(KEY_ENV, SECRET)
    caplog.set_level("DEBUG")
    with pytest.raises(BackendError) as info:
        run(lambda b: _collect(b, _request("status:401")), _backend(upstream, api_key_env=KEY_ENV))
    assert upstream.seen_headers[-1]["authorization"] == f"Bearer {SECRET}"
    assert SECRET not in str(info.value) and SECRET not in json.dumps(info.value.body())
    assert "credentials" in caplog.text and SECRET not in caplog.text


def test_missing_key_variable_fails_start_naming_the_variable_only(upstream, monkeypatch):
    monkeypatch.delenv(KEY_ENV, raising=False)
    with pytest.raises(RuntimeError, match=KEY_ENV):
        asyncio.run(_backend(upstream, api_key_env=KEY_ENV).start())


VLLM_PAGE = """# HELP vllm:num_requests_waiting Requests waiting.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="1",model_name="m"} 2.0
vllm:num_requests_running{engine="0",model_name="m"} 7.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5
vllm:e2e_request_latency_seconds_bucket{le="1.0",model_name="m"} 4.0
"""
OLD_VLLM_PAGE = "vllm:num_requests_waiting 1\nvllm:num_requests_running 2\nvllm:gpu_cache_usage_perc 0.75\n"
SGLANG_PAGE = 'sglang:num_queue_reqs{tp_rank="0"} 4\nsglang:num_running_reqs{tp_rank="0"} 9\nsglang:token_usage 0.6\n'
TRTLLM_PAGE = "trtllm_num_requests_waiting 6\ntrtllm_num_requests_running 1\ntrtllm_kv_cache_utilization 0.125\n"
TRTLLM_OLD_PAGE = "num_requests_waiting 2\nnum_requests_running 3\nkv_cache_utilization 0.5\n"


@pytest.mark.parametrize("preset,page,expected", [
    ("vllm", VLLM_PAGE, (5, 7, 0.5)),  # counts summed over engines, the fullest KV cache
    ("auto", VLLM_PAGE, (5, 7, 0.5)),
    ("kvgate", VLLM_PAGE, (5, 7, 0.5)),
    ("vllm", OLD_VLLM_PAGE, (1, 2, 0.75)),
    ("sglang", SGLANG_PAGE, (4, 9, 0.6)),
    ("auto", SGLANG_PAGE, (4, 9, 0.6)),
    ("trtllm", TRTLLM_PAGE, (6, 1, 0.125)),
    ("auto", TRTLLM_PAGE, (6, 1, 0.125)),
    ("trtllm", TRTLLM_OLD_PAGE, (2, 3, 0.5)),
])
def test_metrics_pages_of_each_engine(preset, page, expected):
    reading = metrics.parse(page, preset)
    assert (reading.waiting, reading.running, reading.kv_cache_usage) == expected


def test_metrics_page_without_known_names_gives_nothing():
    assert metrics.parse("process_cpu_seconds_total 3\n", "auto") is None
    assert metrics.parse(SGLANG_PAGE, "vllm") is None


@pytest.mark.parametrize("preset,page,expected", [
    ("vllm", VLLM_PAGE, (5, 7, 0.5)),
    ("trtllm", TRTLLM_PAGE, (6, 1, 0.125)),
])
def test_load_comes_from_the_upstream_metrics_and_goes_stale(upstream, preset, page, expected):
    upstream.metrics_text, upstream.metrics_hang = page, False
    backend = _backend(upstream, metrics=preset, metrics_url=upstream.base_url + "/metrics",
                       metrics_poll_s=0.05, metrics_stale_s=0.3, unhealthy_after=2)

    async def go(b):
        load = await _wait_for(b, lambda s: "metrics_stale" not in s.extra)
        upstream.metrics_hang = True  # the endpoint stops answering
        stale = await _wait_for(b, lambda s: "metrics_stale" in s.extra)
        sick = await _wait_for(b, lambda s: not s.healthy)  # after `unhealthy_after` timed-out scrapes
        upstream.metrics_hang = False
        healed = await _wait_for(b, lambda s: s.healthy and "metrics_stale" not in s.extra)
        return load, stale, sick, healed

    load, stale, sick, healed = run(go, backend)
    assert (load.waiting, load.running, load.kv_cache_usage) == expected and load.healthy
    assert stale.extra["metrics_age_s"] > 0.3 and (stale.waiting, stale.running) == (0, 0)
    assert not sick.healthy and healed.waiting == expected[0]


def test_scrapes_go_on_while_every_connection_carries_a_generation(upstream):
    """Scrapes have a connection of their own: a pool whose only connection a stalled stream
    holds neither makes the metrics stale nor the deployment unhealthy."""
    upstream.metrics_text, upstream.metrics_hang = VLLM_PAGE, False
    backend = _backend(upstream, max_connections=1, metrics="vllm", metrics_url=upstream.base_url + "/metrics",
                       metrics_poll_s=0.05, metrics_stale_s=0.3, unhealthy_after=2)

    async def go(b):
        await _wait_for(b, lambda s: "metrics_stale" not in s.extra)
        holder = asyncio.create_task(_collect(b, _request("slow")))  # three tokens, then silence
        try:
            await asyncio.sleep(0.2)
            read_at = b.tracker.read_at
            await asyncio.sleep(1.0)  # over three stale periods, every connection taken
            return read_at, b.tracker.read_at, b.load()
        finally:
            holder.cancel()
            await asyncio.gather(holder, return_exceptions=True)

    read_at, later, load = run(go, backend)
    assert later > read_at and load.healthy and "metrics_stale" not in load.extra
    assert (load.waiting, load.running) == (5, 7)


def test_without_metrics_load_is_the_in_flight_count(upstream):
    async def go(b):
        request = _request("slow")
        async for _ in b.generate(request):
            load = b.load()
            await b.abort(request.request_id)
        return load, b.load()

    during, after = run(go, _backend(upstream, metrics="none"))
    assert during.running == 1 and after.running == 0 and "metrics_stale" in during.extra


async def _wait_for(backend, predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        snapshot = backend.load()
        if predicate(snapshot):
            return snapshot
        await asyncio.sleep(0.02)
    raise AssertionError(f"load never matched: {backend.load()}")


# -- through a front gateway: what the client sees ----------------------------------------------

FRONT_OF_UPSTREAM = """
models:
  - name: m
    deployments:
      - name: up-0
        backend: openai
        settings:
          base_url: {base}/v1
          metrics: none
          first_byte_s: 0.5
          idle_s: 0.5
"""


@pytest.fixture(scope="module")
def front(upstream):
    with GatewayServer(FRONT_OF_UPSTREAM.format(base=upstream.base_url)) as server:
        yield server


@pytest.mark.parametrize("script,status,code", [
    ("status:400", 400, "invalid_value"),
    ("vllm400", 400, "context_length_exceeded"),
    ("status:404", 404, "model_not_found"),
    ("status:401", 502, "upstream_error"),
    ("status:429", 429, "rate_limit_exceeded"),
    ("status:503", 503, "server_is_overloaded"),
    ("status:500", 502, "upstream_error"),
    ("stall-first", 504, "timeout"),
])
def test_client_sees_the_mapped_status_and_code(front, script, status, code):
    r = httpx.post(front.base_url + "/v1/completions", json={"model": "m", "prompt": script}, timeout=10)
    assert r.status_code == status
    assert r.json()["error"]["code"] == code
    if status in (429, 503):
        assert r.headers["retry-after"] == "7"


@pytest.mark.parametrize("script", ["drop-mid", "stall-mid", "error-mid"])
def test_upstream_failing_mid_stream_gives_one_error_event_then_done(front, script):
    body = {"model": "m", "messages": [{"role": "user", "content": script}], "stream": True}
    with httpx.stream("POST", front.base_url + "/v1/chat/completions", json=body, timeout=10) as r:
        assert r.status_code == 200
        events = [line for line in r.iter_lines() if line]
    errors = [e for e in events if '"error"' in e]
    assert len(errors) == 1 and json.loads(errors[0][6:])["error"]["type"] == "server_error"
    assert events[-1] == "data: [DONE]" and events.index(errors[0]) == len(events) - 2


def test_openai_client_raises_on_the_mid_stream_error(front):
    client = front.openai()
    with pytest.raises(openai.APIError):
        for _ in client.completions.create(model="m", prompt="drop-mid", stream=True):
            pass


# -- settings --------------------------------------------------------------------------------

@pytest.mark.parametrize("settings,message", [
    ({}, r"settings\.base_url: Field required"),
    ({"base_url": "ftp://x"}, r"settings\.base_url: must be an http"),
    ({"base_url": "http://x/v1", "metrics": "prom"}, r"settings\.metrics: "),
    ({"base_url": "http://x/v1", "idle_s": 0}, r"settings\.idle_s: "),
    ({"base_url": "http://x/v1", "api_key": "sk-inline"}, r"settings\.api_key: unknown key"),
])
def test_bad_settings_name_the_field(settings, message):
    with pytest.raises(ValueError, match=message):
        make_openai_backend(settings, "d")


def test_default_scrape_urls():
    def url(**kw):
        return make_openai_backend({"base_url": "http://h:8000/v1", **kw}, "d").settings.scrape_url()

    assert url() == "http://h:8000/metrics"
    assert url(metrics="trtllm") == "http://h:8000/prometheus/metrics"
    assert url(metrics="none") is None
    assert url(metrics_url="http://h:9000/m") == "http://h:9000/m"


def test_upstream_streams_only_for_streaming_clients(front, upstream):
    httpx.post(front.base_url + "/v1/completions", json={"model": "m", "prompt": "plain"}, timeout=10)
    assert upstream.seen_bodies[-1]["stream"] is False and "stream_options" not in upstream.seen_bodies[-1]
    with httpx.stream("POST", front.base_url + "/v1/completions",
                      json={"model": "m", "prompt": "plain", "stream": True}, timeout=10) as r:
        r.read()
    assert upstream.seen_bodies[-1]["stream"] is True
    assert upstream.seen_bodies[-1]["stream_options"] == {"include_usage": True}


def test_continuous_usage_is_asked_of_the_upstream_only_when_the_client_asks(upstream):
    for continuous, options in [(False, {"include_usage": True}),
                                (True, {"include_usage": True, "continuous_usage_stats": True})]:
        run(lambda b: _collect(b, _request("ok", continuous_usage=continuous)), _backend(upstream))
        assert upstream.seen_bodies[-1]["stream_options"] == options


def test_an_upstream_that_ignores_continuous_usage_gets_the_output_counted_by_the_gateway(front):
    """This upstream sends usage only at the end (as llama.cpp's server): the chunks before say
    the output tokens counted so far, prompt tokens 0 until the upstream's totals come."""
    body = {"model": "m", "prompt": "ok", "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    r = httpx.post(front.base_url + "/v1/completions", json=body, timeout=10)
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert [c["usage"]["completion_tokens"] for c in chunks[:3]] == [1, 2, 3]
    assert {c["usage"]["prompt_tokens"] for c in chunks[:3]} == {0}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens"] == 5
