"""The upstream connection pool: httpx clients, each owning a slice of the connections.

One httpx.AsyncClient with hundreds of connections spends most of a busy gateway's CPU in
httpcore's pool bookkeeping, which walks every connection (and asks each idle socket whether it
is readable) on every request start and every response close: at 128 concurrent streams that
was 40% of kvgate's profile. Slices of at most SLICE connections keep each walk short; a request
goes to the slice with the fewest requests in flight, so the slices fill evenly and a request
never waits for a connection while another slice has one free.

Idle connections expire after `keepalive_expiry_s`, set below the keep-alive timeouts of common
upstreams (uvicorn, which serves vLLM, SGLang and trtllm-serve, closes idle connections after
5 s): a connection the upstream is about to close is rarely reused. The
rare one that is still reused at the very moment the upstream closes it fails before any response
byte; `fresh` is the client for the one retry of such a request: it keeps no idle connections, so
the retry always opens a new one.
"""

from __future__ import annotations

import logging
import math
import ssl

import httpx

log = logging.getLogger("kvgate.openai")

SLICE = 16
# How a connection that the upstream closed under our request fails before any response byte:
# FIN (h11: "Server disconnected without sending a response"), RST while reading or writing.
DROPPED = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)


class ClientPool:
    def __init__(self, max_connections: int, keepalive_expiry_s: float = 4.0, **client_kwargs):
        slices = math.ceil(max_connections / SLICE)
        per_slice = math.ceil(max_connections / slices)
        limits = httpx.Limits(max_connections=per_slice, max_keepalive_connections=per_slice,
                              keepalive_expiry=keepalive_expiry_s)
        # One TLS context for all slices: each client would otherwise load the CA bundle (~0.1 s).
        client_kwargs.setdefault("verify", _tls_context())
        self.clients = [httpx.AsyncClient(limits=limits, **client_kwargs) for _ in range(slices)]
        self.in_flight = [0] * slices
        never_idle = httpx.Limits(max_connections=per_slice, max_keepalive_connections=0)
        self.fresh = httpx.AsyncClient(limits=never_idle, **client_kwargs)
        self.reuse_retries = 0

    def take(self) -> int:
        """The slice for a new request (counted in flight until `give_back`)."""
        index = min(range(len(self.in_flight)), key=self.in_flight.__getitem__)
        self.in_flight[index] += 1
        return index

    def give_back(self, index: int) -> None:
        self.in_flight[index] -= 1

    async def send(self, index: int, method: str, url: str, **kwargs) -> httpx.Response:
        """Send on slice `index` (streamed response); a request that a reused connection dropped
        before its response began is sent once more, on a new connection (`fresh`)."""
        watch = _ConnectWatch()
        client = self.clients[index]
        request = client.build_request(method, url, extensions={"trace": watch}, **kwargs)
        try:
            return await client.send(request, stream=True)
        except DROPPED as exc:
            if watch.connected:  # a new connection failed: that is the upstream's doing
                raise
            self.reuse_retries += 1
            log.info("%s: a reused connection closed under a request (%s); retrying on a new connection",
                     url, type(exc).__name__)
        return await self.fresh.send(self.fresh.build_request(method, url, **kwargs), stream=True)

    @property
    def any(self) -> httpx.AsyncClient:
        """A client for side requests (metrics scrapes)."""
        return self.clients[0]

    async def aclose(self) -> None:
        for client in (*self.clients, self.fresh):
            await client.aclose()


class _ConnectWatch:
    """httpcore's trace callback: did this request open a connection, or reuse an idle one?"""

    def __init__(self):
        self.connected = False

    async def __call__(self, event: str, info: dict) -> None:
        if event.startswith("connection.connect_"):  # connect_tcp / connect_unix_socket
            self.connected = True


def _tls_context() -> ssl.SSLContext:
    try:
        import certifi  # what httpx itself verifies against
    except ImportError:
        return ssl.create_default_context()
    return ssl.create_default_context(cafile=certifi.where())
