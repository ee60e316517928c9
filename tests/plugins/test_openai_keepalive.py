"""The keep-alive race of the `openai` backend, reproduced deterministically.

An upstream closes an idle keep-alive connection after its timeout (uvicorn: 5 s); a pooled
connection reused at that very moment carries our request into a socket that is closing, and
the request fails before any response byte. `RacingUpstream` below makes that moment certain: it
serves the first request of each connection and closes the connection (FIN, or RST) as soon as a
later request arrives on it. The backend must send such a request once more on a new connection,
must not charge the upstream for it, and must not retry a request whose connection was new.
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct

import pytest

from gateway.backend import GenerationRequest, SamplingParams
from gateway.errors import BackendError
from kvgate_openai import make_openai_backend
from tests.support.servers.loopback import GatewayServer, ScriptedServer, content_length

WORDS = ["one", " two", " three"]


class RacingUpstream(ScriptedServer):
    """A minimal HTTP/1.1 OpenAI upstream on loopback, in its own thread and event loop.

    drop: which requests are answered by closing the connection instead:
      "none"    - none;
      "reused"  - every request after the first on a connection (the keep-alive race);
      "all"     - every request (an upstream that is down after accepting connections);
      "later"   - every request after the first one it served, on any connection.
    how: "fin" (a plain close) or "rst" (SO_LINGER 0: the peer sees a connection reset).
    """

    def __init__(self, drop: str = "reused", how: str = "fin"):
        self.drop, self.how = drop, how
        self.connections = 0
        self.served = 0
        self.dropped = 0
        super().__init__()

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        nth = 0
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return  # the client closed its idle connection
                if self._should_drop(nth):
                    self.dropped += 1
                    self._abandon(writer)
                    return
                body = await reader.readexactly(content_length(head))
                writer.write(_sse_response(json.loads(body)))
                await writer.drain()
                self.served += 1
                nth += 1
        finally:
            writer.close()

    def _should_drop(self, nth: int) -> bool:
        return {"none": False, "reused": nth > 0, "all": True, "later": self.served > 0}[self.drop]

    def _abandon(self, writer: asyncio.StreamWriter) -> None:
        if self.how == "rst":
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.close()


def _sse_response(request: dict) -> bytes:
    chat = "messages" in request
    chunks = [_chunk(chat, word, None) for word in WORDS] + [_chunk(chat, "", "stop")]
    chunks.append({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": len(WORDS)}})
    body = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"
    head = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\n\r\n")
    return head + body


def _chunk(chat: bool, text: str, finish) -> dict:
    if chat:
        return {"object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}]}
    return {"object": "text_completion", "choices": [{"index": 0, "text": text, "finish_reason": finish}]}


@pytest.fixture
def upstream(request):
    server = RacingUpstream(*getattr(request, "param", ("reused", "fin")))
    yield server
    server.close()


def _backend(upstream, **settings):
    return make_openai_backend({"base_url": upstream.base_url + "/v1", "metrics": "none", **settings}, "up-0")


def _request(i: int) -> GenerationRequest:
    return GenerationRequest(request_id=f"r-{i}", model="m", prompt="hello", sampling=SamplingParams(max_tokens=3),
                             stream=True)


def _run(backend, count: int, pause_s: float = 0.0):
    """Send `count` requests one after another on a started backend.
    Returns (each request's text or error, how many requests the pool sent again)."""
    async def main():
        await backend.start()
        out = []
        try:
            for i in range(count):
                if i and pause_s:
                    await asyncio.sleep(pause_s)
                try:
                    out.append("".join([e.text async for e in backend.generate(_request(i))]))
                except BackendError as exc:
                    out.append(exc)
            return out, backend._pool.reuse_retries
        finally:
            await backend.stop()
    return asyncio.run(main())


@pytest.mark.parametrize("upstream", [("reused", "fin"), ("reused", "rst")], indirect=True, ids=["fin", "rst"])
def test_request_dropped_by_a_reused_connection_is_sent_again_on_a_new_one(upstream):
    backend = _backend(upstream)
    texts, retries = _run(backend, 4)
    assert texts == ["one two three"] * 4
    # Connections: A serves 1 and drops 2; B (new) serves 2's retry and is not kept; the pool
    # opens C for 3, which drops 4; D serves 4's retry.
    assert upstream.dropped == retries == 2
    assert upstream.connections == 4
    assert backend.tracker.failures == 0  # not counted against the upstream's health


@pytest.mark.parametrize("upstream", [("none", "fin")], indirect=True)
def test_healthy_keep_alive_reuses_one_connection(upstream):
    texts, retries = _run(_backend(upstream), 3)
    assert texts == ["one two three"] * 3
    assert upstream.connections == 1 and retries == 0


@pytest.mark.parametrize("upstream", [("all", "fin"), ("all", "rst")], indirect=True, ids=["fin", "rst"])
def test_a_new_connection_that_fails_is_not_retried(upstream):
    backend = _backend(upstream)
    [result], retries = _run(backend, 1)
    assert isinstance(result, BackendError) and "cannot be reached" in result.message
    assert upstream.connections == 1 and upstream.dropped == 1 and retries == 0
    assert backend.tracker.failures == 1


@pytest.mark.parametrize("upstream", [("later", "fin")], indirect=True)
def test_the_retry_happens_once_and_its_failure_counts(upstream):
    backend = _backend(upstream)
    (first, second), retries = _run(backend, 2)
    assert first == "one two three"
    assert isinstance(second, BackendError)
    assert upstream.dropped == 2 and upstream.connections == 2 and retries == 1  # the reused one, one retry
    assert backend.tracker.failures == 1


@pytest.mark.parametrize("upstream", [("reused", "fin")], indirect=True)
def test_idle_connections_expire_before_the_upstream_closes_them(upstream):
    texts, retries = _run(_backend(upstream, keepalive_expiry_s=0.1), 2, pause_s=0.5)
    assert texts == ["one two three"] * 2
    assert upstream.dropped == 0 and retries == 0 and upstream.connections == 2  # the idle one was let go


GATEWAY = """
models:
  - name: m
    breaker: {{failures: 1, cooldown_s: 60}}
    deployments:
      - name: up-0
        backend: openai
        settings: {{base_url: "{base}/v1", metrics: none}}
"""


@pytest.mark.parametrize("upstream", [("reused", "rst")], indirect=True)
def test_through_the_gateway_the_race_costs_neither_a_502_nor_the_breaker(upstream):
    with GatewayServer(GATEWAY.format(base=upstream.base_url)) as gw:
        client = gw.openai()
        for _ in range(4):
            stream = client.completions.create(model="m", prompt="hello", max_tokens=3, stream=True)
            assert "".join(c.choices[0].text for c in stream if c.choices) == "one two three"
        deployment = next(d for d in gw.state.registry.deployments() if d.name == "up-0")
        assert deployment.breaker.state == "closed" and deployment.breaker.consecutive_failures == 0
        assert gw.backend("up-0")._pool.reuse_retries == upstream.dropped == 2
