"""A hostile upstream on loopback, one misbehaviour per model: each request gets a clear 502
naming the reason (a 429 with a bounded wait for Retry-After: inf), the gateway's memory stays
bounded, and a well-behaved model served beside it is unaffected. Each test against the gateway
runs over both of the openai backend's clients: h1.py (plain http) and aiohttp (https and
proxies; here HTTP_PROXY names the hostile server, which answers a proxied request as any other)."""

from __future__ import annotations

import asyncio
import gzip
import json
import tracemalloc

import httpx
import pytest

from kvgate_openai.sse import SSEDecoder
from tests.support.servers.loopback import GatewayServer, ScriptedServer, content_length

BOMB = gzip.compress(b"a" * (128 << 20), compresslevel=9)  # ~130 KB that inflate to 128 MiB
USAGE = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}


def completion(usage=USAGE) -> bytes:
    return json.dumps({"id": "c", "object": "text_completion", "created": 0, "model": "m",
                       "choices": [{"index": 0, "text": "ok", "finish_reason": "stop", "logprobs": None}],
                       "usage": usage}).encode()


def answer(status: str, body: bytes, head: bytes = b"") -> bytes:
    return (b"HTTP/1.1 " + status.encode() + b"\r\ncontent-type: application/json\r\n" + head
            + b"content-length: %d\r\n\r\n" % len(body) + body)


def endless_stream() -> bytes:
    """An upstream that runs to its own context: 2,000 tokens."""
    chunk = b'data: {"id": "c", "object": "text_completion", "choices": [{"index": 0, "text": " a", "finish_reason": null}]}\n\n'
    return (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
            + b"".join(b"%x\r\n%b\r\n" % (len(chunk), chunk) for _ in range(2000)) + b"0\r\n\r\n")


ANSWERS = {
    "endless": endless_stream(),
    "fine": answer("200 OK", completion()),
    "bomb": answer("200 OK", BOMB, b"content-encoding: gzip\r\n"),
    "many-headers": answer("200 OK", completion(), b"".join(b"x-h%d: v\r\n" % i for i in range(5000))),
    "huge-header": answer("200 OK", completion(), b"x-big: " + b"v" * (1 << 20) + b"\r\n"),
    "wide-head": answer("200 OK", completion(), b"".join(b"x-w%d: %b\r\n" % (i, b"v" * 2000) for i in range(60))),
    "negative-usage": answer("200 OK", completion({**USAGE, "prompt_tokens": -5})),
    "fractional-usage": answer("200 OK", completion({**USAGE, "completion_tokens": 1.5})),
    "retry-after-inf": answer("429 Too Many Requests", b'{"error": {"message": "slow down"}}', b"retry-after: inf\r\n"),
}


class Hostile(ScriptedServer):
    """Answers each request as its model says (the deployment's upstream_model)."""

    async def serve(self, reader, writer):
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                body = await reader.readexactly(content_length(head))
                if head.startswith(b"GET ") and b"/huge-metrics " in head.partition(b"\r\n")[0]:
                    writer.write(answer("200 OK", b"# HELP x\n" * (1 << 20), b"x-kind: metrics\r\n"))
                elif head.startswith(b"GET"):
                    writer.write(answer("200 OK", b"vllm:num_requests_running 3\n"))
                else:
                    writer.write(ANSWERS[json.loads(body)["model"]])
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


def config(base: str) -> str:  # base: the upstream's origin, or a name only the proxy resolves
    models = "server: {limits: {max_tokens: 8}}\nmodels:\n" + "".join(
        f"  - name: {name}\n    deployments:\n      - {{name: {name}-0, backend: openai, upstream_model: {name},\n"
        f"         settings: {{base_url: '{base}/v1', metrics: none, max_body_bytes: 1048576}}}}\n"
        for name in ANSWERS)
    return models


@pytest.fixture(scope="module")
def upstream():
    server = Hostile()
    yield server
    server.close()


@pytest.fixture(scope="module", params=["h1", "aiohttp"])
def gw(upstream, request):
    with pytest.MonkeyPatch.context() as env:
        base = upstream.base_url
        if request.param == "aiohttp":
            env.setenv("HTTP_PROXY", upstream.base_url)
            env.delenv("NO_PROXY", raising=False)
            env.delenv("no_proxy", raising=False)
            base = "http://hostile.invalid"
        with GatewayServer(config(base)) as server:
            assert type(server.backend("fine-0")._pool._client(base + "/v1")).__name__ == {
                "h1": "H1Client", "aiohttp": "AiohttpClient"}[request.param]
            yield server


def complete(gw, model: str) -> httpx.Response:
    return httpx.post(gw.base_url + "/v1/completions", json={"model": model, "prompt": "a b", "max_tokens": 2},
                      timeout=30, trust_env=False)  # to the gateway itself, whatever HTTP_PROXY says


@pytest.mark.parametrize("model,reason", [
    ("bomb", "sent an answer over 1048576 bytes"),
    ("many-headers", "its response head is over 100 headers or 65536 bytes"),
    ("huge-header", "its response head is over 100 headers or 65536 bytes"),
    ("wide-head", "its response head is over 100 headers or 65536 bytes"),  # 60 of 2 KB: 120 KB in all
    ("negative-usage", "usage.prompt_tokens is -5, not a token count"),
    ("fractional-usage", "usage.completion_tokens is 1.5, not a token count"),
])
def test_a_hostile_answer_is_a_502_naming_why_and_others_are_served(gw, model, reason):
    r = complete(gw, model)
    assert r.status_code == 502, r.text
    assert reason in r.json()["error"]["message"]
    assert complete(gw, "fine").status_code == 200


def test_a_decompression_bomb_never_inflates_whole(gw):
    tracemalloc.start()
    try:
        assert complete(gw, "bomb").status_code == 502
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 32 << 20, f"{peak >> 20} MiB at the peak for a 128 MiB bomb"


def test_retry_after_inf_is_a_bounded_wait_not_a_crash(gw):
    r = complete(gw, "retry-after-inf")
    assert r.status_code == 429, r.text
    assert 1 <= int(r.headers["retry-after"]) <= 3600


def test_a_long_line_in_many_pieces_is_decoded_in_linear_time():
    """32 MiB in 4 KiB reads: copying the unfinished line at every read would move ~137 GB
    (the per-test timeout ends that); joined once, it is one copy."""
    decoder = SSEDecoder(max_event_bytes=64 << 20)
    piece = b"x" * 4096
    decoder.feed(b"data: ")
    for _ in range((32 << 20) // len(piece)):
        assert decoder.feed(piece) == []
    [payload] = decoder.feed(b"\n\n")
    assert len(payload) == 32 << 20


def test_a_metrics_page_over_the_bound_is_not_read(upstream):
    from kvgate_openai.load import _scrape
    from kvgate_openai.pool import ClientPool

    async def main():
        pool = ClientPool(1, connect_s=5, headers={})
        try:
            _, huge = await _scrape(pool, upstream.base_url + "/huge-metrics", limit=1 << 20)
            _, page = await _scrape(pool, upstream.base_url + "/metrics", limit=1 << 20)
        finally:
            await pool.aclose()
        return huge, page

    huge, page = asyncio.run(main())
    assert huge is None  # 9 MiB: stopped at 1 MiB, never held whole
    assert page == "vllm:num_requests_running 3\n"


def test_a_request_naming_no_max_tokens_is_cut_at_the_servers_bound_upstream_too(gw):
    """The bound is not sent upstream (it may exceed the upstream's context): the stream is cut
    at it instead, here after 8 of the upstream's 2,000 tokens."""
    body = {"model": "endless", "prompt": "a", "stream": True, "max_tokens": None}
    with httpx.stream("POST", gw.base_url + "/v1/completions", json=body, timeout=30, trust_env=False) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    text = "".join(c["text"] for e in events for c in e["choices"])
    assert text == " a" * 8 and events[-1]["choices"][0]["finish_reason"] == "length"
