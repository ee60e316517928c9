"""Events that arrive together pass the gateway together (Backend.generate_batches).

The `openai` backend yields the tokens of one upstream read as one list; the gateway passes each
list through its layers once and writes it out in one piece. What the client sees must not
change: one SSE event per token, the same framing, errors after the tokens that came before
them, the inter-token histogram counting every gap. A third-party backend may batch too: an
empty list is no output, and nothing after a list's finishing event is read.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from gateway.backend import Backend, GenerationRequest, LoadSnapshot, SamplingParams, TokenEvent, Usage
from gateway.hookspecs import hookimpl
from gateway.observability.metrics import observe_times
from kvgate_openai import make_openai_backend
from tests.support.servers.loopback import GatewayServer, ScriptedServer, content_length

WORDS = [" alpha", " beta", " gamma", " delta", " epsilon"]


def _chunk(text: str, finish: str | None = None, usage: dict | None = None) -> bytes:
    body = {"id": "x", "object": "text_completion", "created": 0, "model": "m",
            "choices": [] if text is None else [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}
    if usage:
        body["usage"] = usage
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def _burst(error_after: int | None = None) -> bytes:
    """A whole streamed answer as one chunked HTTP body: every token, finish, usage, [DONE]."""
    events = [_chunk(w) for w in WORDS[:error_after]]
    if error_after is not None:
        events.append(b'data: {"error": {"message": "engine fell over", "type": "server_error"}}\n\n')
    else:
        events += [_chunk("", "length"), _chunk(None, usage={"prompt_tokens": 3, "completion_tokens": 5,
                                                            "total_tokens": 8}), b"data: [DONE]\n\n"]
    body = b"".join(events)
    return b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)


class BurstUpstream(ScriptedServer):
    """Answers every POST with its whole SSE stream in ONE write (a fast upstream, a slow reader)."""

    def __init__(self, error_after: int | None = None):
        self.body = _burst(error_after)
        super().__init__()

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                await reader.readexactly(content_length(head))
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                             b"transfer-encoding: chunked\r\n\r\n" + self.body)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()


@pytest.fixture
def burst():
    upstream = BurstUpstream()
    yield upstream
    upstream.close()


def _request(stream: bool = True) -> GenerationRequest:
    return GenerationRequest("burst-1", "m", SamplingParams(max_tokens=5), prompt="go", stream=stream)


async def _batches_and_events(base_url: str):
    backend = make_openai_backend({"base_url": base_url + "/v1", "metrics": "none"}, "up")
    await backend.start()
    try:
        batches = [b async for b in backend.generate_batches(_request())]
        events = [e async for e in backend.generate(_request())]
    finally:
        await backend.stop()
    return batches, events


def test_one_upstream_read_is_one_batch_and_generate_still_yields_one_event_each(burst):
    batches, events = asyncio.run(_batches_and_events(burst.base_url))
    assert len(batches) == 1, batches  # the answer came in one read, body end included
    assert [e.text for e in batches[0]] == WORDS + [""]
    assert batches[0][-1].finish_reason == "length" and batches[0][-1].usage == Usage(3, 5)
    assert events == batches[0]


GATEWAY = """
models:
  - name: m
    deployments:
      - name: up
        backend: openai
        settings: {{base_url: "{base}/v1", metrics: none}}
"""


def sse_events(raw: bytes) -> list:
    """The `data:` payloads of an SSE body, JSON-decoded ("[DONE]" as is)."""
    payloads = [e.removeprefix(b"data: ") for e in raw.split(b"\n\n") if e]
    return [p.decode() if p == b"[DONE]" else json.loads(p) for p in payloads]


def _stream_texts(gateway: GatewayServer) -> tuple[list[dict], list[bytes]]:
    body = {"model": "m", "prompt": "go", "max_tokens": 5, "stream": True}
    with httpx.stream("POST", gateway.base_url + "/v1/completions", json=body, timeout=10) as r:
        assert r.status_code == 200
        raw = b"".join(r.iter_raw())
    return sse_events(raw), raw


def test_a_burst_reaches_the_client_as_one_event_per_token_and_every_gap_is_counted(burst):
    with GatewayServer(GATEWAY.format(base=burst.base_url)) as gateway:
        for _ in range(3):
            events, raw = _stream_texts(gateway)
            assert raw.endswith(b"data: [DONE]\n\n") and raw.count(b"data: ") == len(WORDS) + 2
            texts = [e["choices"][0]["text"] for e in events if e != "[DONE]"]
            assert texts == WORDS + [""]
            assert [e["choices"][0]["finish_reason"] for e in events if e != "[DONE]"][-1] == "length"
        metrics = httpx.get(gateway.base_url + "/metrics").text
    # 5 tokens then the finishing event: 5 gaps per request, 3 requests; all of them 0 (< 1 ms).
    assert 'kvgate_inter_token_latency_seconds_count{model="m"} 15.0' in metrics
    assert 'kvgate_inter_token_latency_seconds_bucket{le="0.001",model="m"} 15.0' in metrics


def test_an_error_after_tokens_of_the_same_read_comes_after_them():
    upstream = BurstUpstream(error_after=2)
    try:
        with GatewayServer(GATEWAY.format(base=upstream.base_url)) as gateway:
            events, raw = _stream_texts(gateway)
    finally:
        upstream.close()
    assert [e["choices"][0]["text"] for e in events[:2]] == WORDS[:2]
    assert "engine fell over" in events[2]["error"]["message"]  # the one error event, then [DONE]
    assert events[3:] == ["[DONE]"]


class ScriptedBatches(Backend):
    """A third-party backend that batches: it yields the lists it was given, as given."""

    def __init__(self, script):
        self.script = script

    async def start(self):
        pass

    async def stop(self):
        pass

    async def abort(self, request_id):
        pass

    def load(self):
        return LoadSnapshot()

    def generate(self, request):
        raise AssertionError("the gateway must read generate_batches")

    async def generate_batches(self, request):
        for batch in self.script:
            yield batch


class ScriptedPlugin:
    def __init__(self, script):
        self.script = script

    @hookimpl
    def register_backends(self, register, config):
        register("scripted", lambda settings, name: ScriptedBatches(self.script))


SCRIPTED = """
models:
  - name: m
    deployments:
      - name: s
        backend: scripted
"""


def test_a_batching_plugin_empty_lists_are_no_output_and_nothing_after_the_finish_is_sent():
    script = [[], [TokenEvent(text="one")], [],
              [TokenEvent(text=" two"), TokenEvent(text="", finish_reason="stop", usage=Usage(1, 2)),
               TokenEvent(text=" never")]]
    with GatewayServer(SCRIPTED, extra_plugins={"scripted": ScriptedPlugin(script)}) as gateway:
        events, _ = _stream_texts(gateway)
        whole = httpx.post(gateway.base_url + "/v1/completions", json={"model": "m", "prompt": "go"}).json()
    assert [e["choices"][0]["text"] for e in events if e != "[DONE]"] == ["one", " two", ""]
    assert whole["choices"][0]["text"] == "one two" and whole["choices"][0]["finish_reason"] == "stop"
    assert whole["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("amount", [0.0, 0.0005, 0.001, 0.004, 7.0, 1e9])
def test_observe_times_equals_observing_one_at_a_time(amount):
    def exposition(observe) -> list[str]:
        registry = CollectorRegistry()
        child = Histogram("gap", "gap", ["model"], registry=registry, buckets=(0.001, 0.005, 1.0)).labels("m")
        observe(child)
        return [line for line in generate_latest(registry).decode().splitlines() if "_created" not in line]

    one_by_one = exposition(lambda h: [h.observe(amount) for _ in range(6)])
    assert exposition(lambda h: observe_times(h, amount, 6)) == one_by_one
    assert f'gap_count{{model="m"}} 6.0' in one_by_one
