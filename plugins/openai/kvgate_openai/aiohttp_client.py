"""aiohttp as a `transport.KeepAliveClient`: the `openai` backend's client for https upstreams
and proxied ones (HTTP(S)_PROXY, NO_PROXY), whose TLS and proxy handling h1.py does not repeat.

Two sessions: `_session` keeps idle connections for `keepalive_expiry_s`; `_fresh` keeps none, so
a retry under the keep-alive rule always opens a new connection, which serves that request only.
"""

from __future__ import annotations

import contextvars
import select
import ssl
import weakref

import aiohttp
from aiohttp.helpers import get_env_proxy_for_url
from aiohttp.http_exceptions import BadHttpMessage, LineTooLong
from yarl import URL

from kvgate_openai.h1 import HeadLimits
from kvgate_openai.transport import (AnswerTooLarge, KeepAliveClient, Response, ReusedConnectionDropped, StreamBroken,
                                    UpstreamUnreachable)

# How a connection that the upstream closed under our request fails before any response byte:
# FIN (ServerDisconnectedError), RST while writing or reading (ClientOSError).
DROPPED = (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)

# Set by `_Connector` when the request being sent (in this task) needed a new connection.
_NEW_CONNECTION: contextvars.ContextVar[list | None] = contextvars.ContextVar("kvgate_new_connection", default=None)


class _Connector(aiohttp.TCPConnector):
    """Says whether a request went out on a new connection, through aiohttp's public API only:
    `connect` (documented: a connection from the pool, or a new one) and `Connection.protocol`
    (one object per TCP connection, the same each time it is reused). A protocol not seen before,
    or a `connect` that failed, is a new connection.

    And never hands out a pooled connection that holds bytes nobody asked for (an upstream's
    second answer to one request, or garbage after it): aiohttp keeps what arrives on an idle
    connection and reads it as the next request's answer. Such a connection is closed and another
    taken: its bytes read already (its protocol's `should_close`, not underscored, says so), or waiting in
    the socket for a busy event loop (poll(2), as h1.py does).

    Not `_create_connection` (an underscored method, which aiohttp's reference does list as the
    one to override, but whose real arguments differ from the documented ones), and not aiohttp's
    trace hooks: a session with any trace config runs its hooks (an awaited signal and an attrs
    object each) at every step of every request and per response chunk read: 34 of the 1,132
    Python calls of a non-streamed request (bench/request_cost.py).
    tests/plugins/test_openai_aiohttp_client.py fails if aiohttp changes what this relies on."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        # the connections handed out before, by protocol: a poll object on each one's socket
        self._seen: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    async def connect(self, *args, **kwargs):
        mark = _NEW_CONNECTION.get()
        while True:
            try:
                connection = await super().connect(*args, **kwargs)
            except BaseException:
                if mark is not None:
                    mark.append(True)  # no connection: nothing was sent on a reused one
                raise
            protocol = connection.protocol
            poller = self._seen.get(protocol)
            if poller is None:
                self._seen[protocol] = _poller(connection)
                if mark is not None:
                    mark.append(True)
                return connection
            if not (protocol.should_close or poller.poll(0)):
                return connection
            connection.close()  # bytes nobody asked for: not this request's answer, nor any other's


def _poller(connection: aiohttp.connector.Connection) -> select.poll:
    """A poll object on the connection's socket (under TLS too: the TCP socket; a TLS record
    that is not data, such as a late session ticket, then costs a new connection, never a wrong
    answer). A connection already lost has no socket: nothing to poll, it fails on its own."""
    poller = select.poll()
    transport = connection.transport
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is not None:
        poller.register(sock.fileno(), select.POLLIN)
    return poller


class _Body:
    """An aiohttp answer's body (a `transport.Body`)."""

    __slots__ = ("_raw",)

    def __init__(self, raw: aiohttp.ClientResponse):
        self._raw = raw

    def complete(self) -> bool:
        return self._raw.content.is_eof()

    async def chunks(self):
        try:
            async for part in self._raw.content.iter_any():
                yield part
        except (aiohttp.ClientError, ConnectionError) as exc:
            raise StreamBroken(type(exc).__name__) from exc

    def close(self) -> None:
        if self._raw.content.at_eof():
            self._raw.release()
        else:
            self._raw.close()


class AiohttpClient(KeepAliveClient):
    """aiohttp sessions, made on first use (they belong to the running event loop)."""

    def __init__(self, max_connections: int, keepalive_expiry_s: float, *, connect_s: float, headers: dict,
                 head_limits: HeadLimits | None = None):
        self.max_connections = max_connections
        self.head_limits = head_limits or HeadLimits()
        self._keepalive_expiry_s = keepalive_expiry_s
        self._headers = headers
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_s)
        self._tls = _tls_context()
        self._session: aiohttp.ClientSession | None = None
        self._fresh: aiohttp.ClientSession | None = None
        self._proxies: dict[str, str | None] = {}

    def proxy(self, url: str) -> str | None:
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

    async def attempt(self, method: str, url: str, content: bytes, headers: dict, *, fresh: bool) -> Response:
        reusing, fresh_only = self._sessions()
        session = fresh_only if fresh else reusing
        new_connection: list = []
        mark = _NEW_CONNECTION.set(new_connection)
        try:
            raw = await session.request(method, url, data=content, headers=headers, proxy=self.proxy(url))
        except DROPPED as exc:
            if new_connection:  # a new connection failed: that is the upstream's doing
                raise UpstreamUnreachable(type(exc).__name__) from exc
            raise ReusedConnectionDropped(type(exc).__name__) from exc
        except aiohttp.ClientResponseError as exc:
            if _head_over_limits(exc):
                raise AnswerTooLarge(self._over_limits()) from exc
            raise UpstreamUnreachable(type(exc).__name__) from exc
        except (aiohttp.ClientError, ConnectionError) as exc:
            raise UpstreamUnreachable(type(exc).__name__) from exc
        finally:
            _NEW_CONNECTION.reset(mark)
        if sum(len(name) + len(value) for name, value in raw.raw_headers) > self.head_limits.max_bytes:
            raw.close()  # each header was under the bound, all of them together are not
            raise AnswerTooLarge(self._over_limits())
        return Response(raw.status, raw.headers, _Body(raw))  # headers: case-insensitive

    def _over_limits(self) -> str:
        """h1.py's words for the same thing: a deployment's 502 reads the same over either client."""
        limits = self.head_limits
        return f"its response head is over {limits.max_headers} headers or {limits.max_bytes} bytes"

    def _sessions(self) -> tuple[aiohttp.ClientSession, aiohttp.ClientSession]:
        if self._session is None:
            reuse = self._keepalive_expiry_s > 0
            self._session = self._new_session(
                _Connector(limit=self.max_connections, limit_per_host=0, ssl=self._tls,
                           keepalive_timeout=self._keepalive_expiry_s if reuse else None,
                           force_close=not reuse))
            self._fresh = self._new_session(_Connector(limit=self.max_connections, ssl=self._tls, force_close=True))
        return self._session, self._fresh

    def _new_session(self, connector) -> aiohttp.ClientSession:
        # trust_env would look up proxies and netrc in a thread on every request; the proxy is
        # looked up once per upstream instead (`proxy`). No cookie jar: a cookie one client's
        # answer set must never ride along on another client's request.
        # The parser bounds a head as h1.py does: max_headers lines, none longer than the whole
        # head's bytes (aiohttp's defaults: 128 headers of 8,190 bytes, ~1 MiB); `attempt` checks
        # the total once the head is in.
        limits = self.head_limits
        return aiohttp.ClientSession(connector=connector, headers=self._headers, timeout=self._timeout,
                                     trust_env=False, cookie_jar=aiohttp.DummyCookieJar(),
                                     max_headers=limits.max_headers, max_field_size=limits.max_bytes,
                                     max_line_size=limits.max_bytes)

    async def aclose(self) -> None:
        for session in (self._session, self._fresh):
            if session is not None:
                await session.close()


def _head_over_limits(exc: aiohttp.ClientResponseError) -> bool:
    """Whether aiohttp's parser refused the head for its size: a line over max_field_size
    (LineTooLong) or more than max_headers ("Too many headers received", C and Python parsers),
    as the error's causes say."""
    cause = exc.__cause__
    while cause is not None:
        if isinstance(cause, LineTooLong) or (isinstance(cause, BadHttpMessage) and "many headers" in str(cause)):
            return True
        cause = cause.__cause__
    return False


def _tls_context() -> ssl.SSLContext:
    try:
        import certifi  # the CAs httpx and requests verify against; the system store may lack public ones
    except ImportError:
        return ssl.create_default_context()
    return ssl.create_default_context(cafile=certifi.where())
