"""The upstream connection pool: our own HTTP/1.1 client (h1.py) for plain-http upstreams,
aiohttp (aiohttp_client.py) for https and proxied ones; both behind `transport.KeepAliveClient`.

Generation requests are the gateway's hot path, and an HTTP client's cost there is Python calls
per streamed chunk: h1.py does only what this backend needs, with httptools' C parser under it,
so it takes the plain-http upstreams (why, and the measurements: docs/design/hot-path.md, "Why
the openai backend has its own HTTP/1.1 client"). https and proxies (HTTP(S)_PROXY) stay on
aiohttp, whose TLS and proxy handling h1.py does not repeat; the choice is made once per URL.
Scrapes of the upstream's /metrics go through a pool of their own (load.py), so a pool busy
with generations never delays them.

Idle connections expire after `keepalive_expiry_s`, set below the keep-alive timeouts of common
upstreams (uvicorn, which serves vLLM, SGLang and trtllm-serve, closes idle connections after
5 s): a connection the upstream is about to close is rarely reused. The rare one that is still
reused at the very moment the upstream closes it is sent once more (transport.KeepAliveClient).
"""

from __future__ import annotations

from kvgate_openai import h1
from kvgate_openai.aiohttp_client import AiohttpClient
from kvgate_openai.h1 import HeadLimits
from kvgate_openai.transport import KeepAliveClient, Response


class ClientPool:
    def __init__(self, max_connections: int, keepalive_expiry_s: float = 4.0, *, headers: dict,
                 connect_s: float, head_limits: HeadLimits | None = None):
        self.max_connections = max_connections
        self.in_flight = 0
        self._h1 = h1.H1Client(max_connections, keepalive_expiry_s, connect_s=connect_s, headers=headers,
                               head_limits=head_limits)
        self._aiohttp = AiohttpClient(max_connections, keepalive_expiry_s, connect_s=connect_s, headers=headers,
                                     head_limits=head_limits)
        self._clients: dict[str, KeepAliveClient] = {}  # by URL: the client that sends to it

    def _client(self, url: str) -> KeepAliveClient:
        """Plain http without a proxy goes through h1; decided the first time a URL is sent to."""
        client = self._clients.get(url)
        if client is None:
            plain = h1.plain_http(url) and self._aiohttp.proxy(url) is None
            client = self._clients[url] = self._h1 if plain else self._aiohttp
        return client

    @property
    def reuse_retries(self) -> int:
        """Requests sent once more because a reused connection dropped them (both clients)."""
        return self._aiohttp.reuse_retries + self._h1.reuse_retries

    @property
    def saturated(self) -> bool:
        """Every connection is taken: a new request waits for one."""
        return self.in_flight > self.max_connections

    def take(self) -> None:
        """Count a request in flight until `give_back` (what `saturated` reads)."""
        self.in_flight += 1

    def give_back(self) -> None:
        self.in_flight -= 1

    async def send(self, method: str, url: str, *, content: bytes, headers: dict) -> Response:
        """Send, and wait for the answer's status and headers (transport.KeepAliveClient.send)."""
        return await self._client(url).send(method, url, content, headers)

    async def aclose(self) -> None:
        await self._h1.aclose()
        await self._aiohttp.aclose()
