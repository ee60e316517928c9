"""The upstream connection pool: our own HTTP/1.1 client (h1.py) for generation requests to
plain-http upstreams, aiohttp for https and proxied ones, httpx for metrics scrapes.

Generation requests are the gateway's hot path, and the HTTP client was its largest cost: httpx
(with httpcore, h11 and anyio under it) ran ~3,500 Python calls per 16-chunk streamed request,
aiohttp (C HTTP parser) ~600, and spent a third of the CPU time (`bench/upstream_overhead.py`,
measured in the closing note of issue 18); aiohttp was then still the largest single cost, and
h1.py does the same work in a fraction of the calls. https and proxies (HTTP(S)_PROXY) stay on
aiohttp, whose TLS and proxy handling h1.py does not repeat; the choice is made once per URL.
Scrapes of the upstream's /metrics are rare and stay on httpx, whose API the load tracker was
written against.

Idle connections expire after `keepalive_expiry_s`, set below the keep-alive timeouts of common
upstreams (uvicorn, which serves vLLM, SGLang and trtllm-serve, closes idle connections after
5 s): a connection the upstream is about to close is rarely reused. The rare one that is still
reused at the very moment the upstream closes it fails before any response byte; such a request
is sent once more on `fresh`, a session that keeps no idle connections, so the retry always opens
a new one (h1.py does the same on its own). (aiohttp retries a dropped reused connection only for idempotent methods; our
requests are POSTs, and a POST that never got a response byte was never run, so one retry is safe.)
"""

from __future__ import annotations

import contextvars
import logging
import ssl

import aiohttp
import httpx
from aiohttp.helpers import get_env_proxy_for_url
from yarl import URL

from kvgate_openai import h1
from kvgate_openai.h1 import AnswerTooLarge, HeadLimits, StreamBroken, UpstreamUnreachable  # what both clients raise

__all__ = ["AnswerTooLarge", "ClientPool", "HeadLimits", "StreamBroken", "UpstreamResponse", "UpstreamUnreachable"]

log = logging.getLogger("kvgate.openai")


# How a connection that the upstream closed under our request fails before any response byte:
# FIN (ServerDisconnectedError), RST while writing or reading (ClientOSError).
DROPPED = (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)

# Set by `_Connector` when the request being sent (in this task) needed a new connection.
_NEW_CONNECTION: contextvars.ContextVar[list | None] = contextvars.ContextVar("kvgate_new_connection", default=None)


class _Connector(aiohttp.TCPConnector):
    """Says whether a request went out on a new connection. aiohttp's trace hooks say it too,
    but a session with any trace config runs its hooks (an awaited signal and an attrs object
    each) at every step of every request and per response chunk read: 34 of the 1,132 Python
    calls of a non-streamed request (bench/request_cost.py)."""

    async def _create_connection(self, req, traces, timeout):
        mark = _NEW_CONNECTION.get()
        if mark is not None:
            mark.append(True)
        return await super()._create_connection(req, traces, timeout)


class UpstreamResponse:
    """A streamed upstream response from aiohttp, with the few parts the backend reads
    (h1.H1Response has the same)."""

    __slots__ = ("_raw", "status_code", "headers")

    def __init__(self, raw: aiohttp.ClientResponse):
        self._raw = raw
        self.status_code = raw.status
        self.headers = raw.headers  # case-insensitive

    def complete(self) -> bool:
        """The whole body has arrived (reading it cannot wait)."""
        return self._raw.content.is_eof()

    async def aiter_bytes(self):
        try:
            async for part in self._raw.content.iter_any():
                yield part
        except (aiohttp.ClientError, ConnectionError) as exc:
            raise StreamBroken(type(exc).__name__) from exc

    async def aclose(self) -> None:
        """Give the connection back when the body was read to its end; otherwise close it, which
        is also how an upstream learns that a request was aborted."""
        if self._raw.content.at_eof():
            self._raw.release()
        else:
            self._raw.close()


class ClientPool:
    def __init__(self, max_connections: int, keepalive_expiry_s: float = 4.0, *, headers: dict,
                 connect_s: float, scrape_timeout_s: float = 5.0, head_limits: HeadLimits | None = None):
        self.max_connections = max_connections
        self.in_flight = 0
        self._aiohttp_retries = 0
        self._tls = _tls_context()
        self._headers = headers
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_s)
        self._keepalive_expiry_s = keepalive_expiry_s
        self._session: aiohttp.ClientSession | None = None
        self._proxies: dict[str, str | None] = {}
        self._fresh: aiohttp.ClientSession | None = None
        self._h1 = h1.H1Client(max_connections, keepalive_expiry_s, connect_s=connect_s, headers=headers,
                               head_limits=head_limits)
        self._plain: dict[str, bool] = {}  # by URL: whether h1 sends it
        self._scrapes = httpx.AsyncClient(headers=headers, verify=self._tls,
                                          timeout=httpx.Timeout(scrape_timeout_s, connect=connect_s))

    def _sessions(self) -> tuple[aiohttp.ClientSession, aiohttp.ClientSession]:
        """Made on first use: aiohttp sessions belong to the running event loop."""
        if self._session is None:
            reuse = self._keepalive_expiry_s > 0
            self._session = self._new_session(
                _Connector(limit=self.max_connections, limit_per_host=0, ssl=self._tls,
                           keepalive_timeout=self._keepalive_expiry_s if reuse else None,
                           force_close=not reuse))
            self._fresh = self._new_session(
                aiohttp.TCPConnector(limit=self.max_connections, ssl=self._tls, force_close=True))
        return self._session, self._fresh

    def _new_session(self, connector) -> aiohttp.ClientSession:
        # trust_env would look up proxies and netrc in a thread on every request; the proxy is
        # looked up once per upstream instead (`_proxy`). No cookie jar: a cookie one client's
        # answer set must never ride along on another client's request.
        return aiohttp.ClientSession(connector=connector, headers=self._headers, timeout=self._timeout,
                                     trust_env=False, cookie_jar=aiohttp.DummyCookieJar())

    def _proxy(self, url: str) -> str | None:
        """The proxy the environment (HTTP(S)_PROXY, NO_PROXY) names for this URL, looked up the
        first time (a deployment sends to a couple of URLs, so the string itself is the key: no
        URL parsing per request)."""
        if url not in self._proxies:
            try:
                proxy, _ = get_env_proxy_for_url(URL(url))
                self._proxies[url] = str(proxy)
            except LookupError:
                self._proxies[url] = None
        return self._proxies[url]

    def _by_h1(self, url: str) -> bool:
        """Plain http without a proxy goes through h1; decided the first time a URL is sent to."""
        plain = self._plain.get(url)
        if plain is None:
            plain = self._plain[url] = h1.plain_http(url) and self._proxy(url) is None
        return plain

    @property
    def reuse_retries(self) -> int:
        """Requests sent once more because a reused connection dropped them (both clients)."""
        return self._aiohttp_retries + self._h1.reuse_retries

    @property
    def saturated(self) -> bool:
        """Every connection is taken: a new request waits for one."""
        return self.in_flight > self.max_connections

    def take(self) -> None:
        """Count a request in flight until `give_back` (what `saturated` reads)."""
        self.in_flight += 1

    def give_back(self) -> None:
        self.in_flight -= 1

    async def send(self, method: str, url: str, *, content: bytes,
                   headers: dict) -> UpstreamResponse | h1.H1Response:
        """Send; a request that a reused connection dropped before its response began is sent
        once more, on a new connection."""
        if self._by_h1(url):
            return await self._h1.request(method, url, content, headers)
        session, fresh = self._sessions()
        new_connection: list = []
        mark = _NEW_CONNECTION.set(new_connection)
        proxy = self._proxy(url)
        try:
            return UpstreamResponse(await session.request(method, url, data=content, headers=headers, proxy=proxy))
        except DROPPED as exc:
            if new_connection:  # a new connection failed: that is the upstream's doing
                raise UpstreamUnreachable(type(exc).__name__) from exc
            self._aiohttp_retries += 1
            log.info("%s: a reused connection closed under a request (%s); retrying on a new connection",
                     url, type(exc).__name__)
        except (aiohttp.ClientError, ConnectionError) as exc:
            raise UpstreamUnreachable(type(exc).__name__) from exc
        finally:
            _NEW_CONNECTION.reset(mark)
        try:
            return UpstreamResponse(await fresh.request(method, url, data=content, headers=headers, proxy=proxy))
        except (aiohttp.ClientError, ConnectionError) as exc:
            raise UpstreamUnreachable(type(exc).__name__) from exc

    @property
    def any(self) -> httpx.AsyncClient:
        """A client for side requests (metrics scrapes)."""
        return self._scrapes

    async def aclose(self) -> None:
        await self._h1.aclose()
        for session in (self._session, self._fresh):
            if session is not None:
                await session.close()
        await self._scrapes.aclose()


def _tls_context() -> ssl.SSLContext:
    try:
        import certifi  # what httpx verifies against; the system store may lack public CAs
    except ImportError:
        return ssl.create_default_context()
    return ssl.create_default_context(cafile=certifi.where())
