"""The upstream connection pool: httpx clients, each owning a slice of the connections.

One httpx.AsyncClient with hundreds of connections spends most of a busy gateway's CPU in
httpcore's pool bookkeeping, which walks every connection (and asks each idle socket whether it
is readable) on every request start and every response close: at 128 concurrent streams that
was 40% of kvgate's profile. Slices of at most SLICE connections keep each walk short; a request
goes to the slice with the fewest requests in flight, so the slices fill evenly and a request
never waits for a connection while another slice has one free.
"""

from __future__ import annotations

import math
import ssl

import httpx

SLICE = 16


class ClientPool:
    def __init__(self, max_connections: int, **client_kwargs):
        slices = math.ceil(max_connections / SLICE)
        per_slice = math.ceil(max_connections / slices)
        limits = httpx.Limits(max_connections=per_slice, max_keepalive_connections=per_slice)
        # One TLS context for all slices: each client would otherwise load the CA bundle (~0.1 s).
        client_kwargs.setdefault("verify", _tls_context())
        self.clients = [httpx.AsyncClient(limits=limits, **client_kwargs) for _ in range(slices)]
        self.in_flight = [0] * slices

    def take(self) -> int:
        """The slice for a new request (counted in flight until `give_back`)."""
        index = min(range(len(self.in_flight)), key=self.in_flight.__getitem__)
        self.in_flight[index] += 1
        return index

    def give_back(self, index: int) -> None:
        self.in_flight[index] -= 1

    @property
    def any(self) -> httpx.AsyncClient:
        """A client for side requests (metrics scrapes)."""
        return self.clients[0]

    async def aclose(self) -> None:
        for client in self.clients:
            await client.aclose()


def _tls_context() -> ssl.SSLContext:
    try:
        import certifi  # what httpx itself verifies against
    except ImportError:
        return ssl.create_default_context()
    return ssl.create_default_context(cafile=certifi.where())
