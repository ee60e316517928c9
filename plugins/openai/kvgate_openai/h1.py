"""A lean HTTP/1.1 client for plain-http upstreams: asyncio.Protocol + httptools' C parser.

A general client's Python calls per request go mostly to generality this backend never uses
(cookies, redirects, payload registry, multidicts, traces), and on the hot path every call
counts per streamed chunk (docs/design/hot-path.md, with the measurements). This client does
only what the `openai` backend needs: POST a body (or GET a metrics page), read a streamed answer. `pool.ClientPool` sends plain `http://` requests without a proxy here
and keeps aiohttp for https and proxies, so TLS and proxy behaviour stay aiohttp's; both are
`transport.KeepAliveClient`s and answer with a `transport.Response`.

    H1Client.send ── slot (FIFO waiters) ── idle connection (LIFO) or a new one
        │                                             │
        └── Response(_Body) <── _Connection(asyncio.Protocol) <── httptools.HttpResponseParser
              chunks: every byte buffered so far in one piece

Connections: at most `max_connections` in use (the rest wait, first come first served) and open
(an idle one to another host gives way); idle ones are kept per (host, port), newest reused
first, and closed after `keepalive_expiry_s` (0: one request per connection). A connection goes
back to the pool only when its answer was read to the end and the answer allows reuse; an answer
abandoned before its end closes its connection (that is how an upstream learns of an abort).
HTTP/1.1 pairs answers with requests by order alone, so a byte past the end of an answer (a
second answer to one request, or garbage) leaves a connection that can never be trusted again:
the parse stops there and the connection is closed, and an idle connection is taken again only
when its socket holds nothing unread (bytes the event loop had no time to read yet would be
taken for the next request's answer). A request that a reused connection dropped is sent once
more under `transport.KeepAliveClient`'s rule, holding its slot.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import select
import socket
import zlib
from collections import deque
from urllib.parse import urlsplit

import httptools

from kvgate_openai.transport import (
    AnswerTooLarge,
    KeepAliveClient,
    Response,
    ReusedConnectionDropped,
    StreamBroken,
    UpstreamUnreachable,
)

log = logging.getLogger("kvgate.openai")

# Reading pauses when this much of an answer is buffered and unread, and resumes once the reader
# takes it: an answer nobody reads cannot fill memory.
HIGH_WATER = 256 * 1024
# Content encodings an answer we did not ask to be compressed may still come in (zlib reads both).
COMPRESSED = ("gzip", "x-gzip", "deflate")
# A host name's addresses are looked up (in a thread: getaddrinfo) at most this often.
DNS_TTL_S = 10.0
# A compressed answer is inflated at most this much at a time: a small body that inflates to
# gigabytes (a "gzip bomb") reaches the readers, and their bounds, in pieces, never whole.
INFLATE_PIECE = 64 * 1024
# Methods whose requests carry no body: no content-length is sent for them.
BODYLESS = ("GET",)


class _PastTheAnswer(Exception):
    """Raised from the parser's callbacks to stop the parse at a second answer to one request."""


class HeadLimits:
    """What an upstream's response head may hold (httptools itself bounds neither)."""

    def __init__(self, max_headers: int = 100, max_bytes: int = 64 * 1024):
        self.max_headers = max_headers
        self.max_bytes = max_bytes


class Headers(dict):
    """Response headers by lower-case name (the first of repeated ones); lookups ignore case."""

    __slots__ = ()

    def get(self, name: str, default=None):
        return dict.get(self, name.lower(), default)

    def __getitem__(self, name: str) -> str:
        return dict.__getitem__(self, name.lower())

    def __contains__(self, name) -> bool:
        return dict.__contains__(self, name.lower())


class _Connection(asyncio.Protocol):
    """One TCP connection; one request on it at a time. The parser calls back into it."""

    __slots__ = ("client", "key", "transport", "parser", "reused", "once", "idle_since", "lost", "active",
                 "headers", "status", "head_done", "framed", "done", "reusable", "error",
                 "got_bytes", "buf", "size", "paused", "waiter", "head_count", "head_bytes", "too_large", "poller")

    def __init__(self, client: H1Client, key: tuple):
        self.client = client
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.reused = False
        self.once = False  # serves one request, then closes
        self.idle_since = 0.0
        self.lost = False
        self.waiter: asyncio.Future | None = None
        self.poller: select.poll | None = None
        self.reset()

    def reset(self) -> None:
        """The state of one exchange."""
        self.active = False  # a request is out and its answer not given back
        self.headers = Headers()
        self.status = 0
        self.head_done = False  # the final (non-1xx) status line and headers are in
        self.framed = False  # content-length or chunked: EOF before the end is a truncation
        self.done = False  # the body ended: message complete, or EOF of a close-delimited body
        self.reusable = False
        self.error: str | None = None
        self.got_bytes = False
        self.head_count = 0  # headers (and trailers) of this answer so far, and their bytes
        self.head_bytes = 0
        self.too_large = False  # error is an AnswerTooLarge
        self.buf: list[bytes] = []
        self.size = 0
        self.paused = False

    # -- asyncio.Protocol ------------------------------------------------------------------

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.poller = select.poll()  # made once: asking it costs one poll(2) per reuse
        self.poller.register(transport.get_extra_info("socket").fileno(), select.POLLIN)

    def data_received(self, data: bytes) -> None:
        if not self.active:  # bytes nobody asked for (an idle or abandoned connection)
            self.close("unexpected data")
            return
        self.got_bytes = True
        try:
            self.parser.feed_data(data)
        except Exception as exc:  # httptools.HttpParserError, HttpParserUpgrade
            self.close(f"bad response: {type(exc).__name__}")
        if self.size > HIGH_WATER and not self.paused and not self.lost:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def eof_received(self):
        if self.active and self.head_done and not self.done and not self.framed:
            self.done = True  # a close-delimited body (HTTP/1.0 style) ends here
        return False  # close our side too

    def connection_lost(self, exc) -> None:
        self.lost = True
        if self.active and not self.done and self.error is None:
            self.error = type(exc).__name__ if exc is not None else (
                "truncated body" if self.head_done else "ServerDisconnected")
        self.client._forget(self)
        self._wake()

    # -- httptools callbacks ---------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self.done:  # a second answer to one request: not this request's, nor the next one's
            self.reusable = False
            raise _PastTheAnswer  # stops the parse before its status or body reach this answer

    def on_header(self, name: bytes, value: bytes) -> None:
        limits = self.client.head_limits
        self.head_count += 1
        self.head_bytes += len(name) + len(value)
        if self.head_count > limits.max_headers or self.head_bytes > limits.max_bytes:
            if not self.too_large:
                self.too_large = True
                self.close(f"its response head is over {limits.max_headers} headers or {limits.max_bytes} bytes")
            return
        if not self.head_done:  # after it: trailers, which we ignore
            self.headers.setdefault(name.decode("latin-1").lower(), value.decode("latin-1"))

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if self.too_large:
            return
        if status < 200:  # an interim answer (100 Continue, 103 Early Hints): the real one follows
            self.headers = Headers()
            return
        self.status = status
        self.head_done = True
        headers = self.headers
        self.framed = (dict.__contains__(headers, "content-length")
                       or "chunked" in dict.get(headers, "transfer-encoding", "").lower())

    def on_body(self, body: bytes) -> None:
        self.buf.append(body)
        self.size += len(body)

    def on_message_complete(self) -> None:
        if self.head_done and not self.done:  # not the end of an interim answer
            self.done = True
            self.reusable = self.parser.should_keep_alive()

    # -- the client's side -----------------------------------------------------------------

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def wait(self) -> asyncio.Future:
        """A future done at the next bytes, the end, or a failure (a plain future, not a
        coroutine: one call less per wait, and there is one wait per upstream read)."""
        self.waiter = waiter = self.client._loop.create_future()
        return waiter

    def unread_bytes_waiting(self) -> bool:
        """Whether the socket holds bytes (or an EOF, or an error) the event loop has not read
        yet: on an idle connection, nothing that any request asked for."""
        return bool(self.poller.poll(0))

    def close(self, why: str = "closed") -> None:
        if self.active and not self.done and self.error is None:
            self.error = why
        if not self.lost:
            self.lost = True
            self.transport.close()
            self.client._forget(self)
        self._wake()


class _Body:
    """An answer's body as it arrives on its connection (a `transport.Body`)."""

    __slots__ = ("_conn", "_client", "_ended", "compressed")

    def __init__(self, client: H1Client, conn: _Connection):
        self._client = client
        self._conn: _Connection | None = conn
        self._ended = False
        # We ask for no compression; an upstream (or a proxy before it) that compresses anyway
        # gets decoded as aiohttp would have, not handed on as bytes no parser can read.
        self.compressed = conn.headers.get("content-encoding", "identity").strip().lower() in COMPRESSED

    def complete(self) -> bool:
        """The whole body has arrived (reading it cannot wait)."""
        conn = self._conn
        return conn is None or conn.done or conn.error is not None

    def chunks(self):
        return self._inflated() if self.compressed else self._raw_bytes()

    async def _inflated(self):
        inflate = zlib.decompressobj(wbits=zlib.MAX_WBITS | 32)  # gzip or zlib, told by the header
        try:
            async for part in self._raw_bytes():
                while part:  # at most INFLATE_PIECE at a time: the readers' bounds see each piece
                    data = inflate.decompress(part, INFLATE_PIECE)
                    part = inflate.unconsumed_tail
                    if data:
                        yield data
            rest = inflate.flush()
        except zlib.error as exc:
            raise StreamBroken(f"bad compressed body: {exc}") from None
        if rest:
            yield rest

    async def _raw_bytes(self):
        # `self._conn` is read anew at every step: once given back, the connection may carry
        # another request, and an `aclose` from another task gives it back.
        while True:
            conn = self._conn
            if conn is None:
                if self._ended:
                    return
                raise StreamBroken("closed")
            buf = conn.buf
            if buf:  # every byte buffered so far, in one piece (inline: this runs per read)
                conn.buf = []
                conn.size = 0
                if conn.paused:
                    conn.paused = False
                    if not conn.lost:
                        conn.transport.resume_reading()
                yield buf[0] if len(buf) == 1 else b"".join(buf)
            elif conn.done:
                self._ended = True
                self.close()
                return
            elif conn.error is not None:
                self.close()
                raise (AnswerTooLarge if conn.too_large else StreamBroken)(conn.error)
            else:
                await conn.wait()

    def close(self) -> None:
        """Give the connection back when the body was read to its end; otherwise close it, which
        is also how an upstream learns that a request was aborted."""
        conn, self._conn = self._conn, None
        if conn is not None:
            self._client._give_back(conn)

    def __del__(self) -> None:
        # A response dropped without aclose must not keep its slot: the pool would run dry.
        if self._conn is not None:
            self.close()


class _Target:
    """What a URL resolves to, worked out once per URL string."""

    __slots__ = ("key", "host", "port", "heads", "_path", "_host_header")

    def __init__(self, url: str):
        parts = urlsplit(url)
        if (parts.scheme != "http" or parts.username is not None or not parts.hostname
                or not url.isascii() or " " in url):  # IDNA and escaping: left to aiohttp
            raise ValueError(f"not a plain http URL: {url}")
        self.host = parts.hostname
        self.port = parts.port or 80
        self.key = (self.host, self.port)
        self._path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        host = f"[{self.host}]" if ":" in self.host else self.host
        self._host_header = host if self.port == 80 else f"{host}:{self.port}"
        self.heads: dict[str, bytes] = {}

    def head(self, method: str, fixed: bytes) -> bytes:
        """The request line, Host and the pool's own headers (`fixed`), per method."""
        head = self.heads.get(method)
        if head is None:
            head = self.heads[method] = (
                f"{method} {self._path} HTTP/1.1\r\nhost: {self._host_header}\r\n".encode() + fixed)
        return head


def plain_http(url: str) -> bool:
    """Whether `H1Client` can send to this URL (plain http, no credentials in it, nothing that
    needs encoding)."""
    try:
        _Target(url)
    except ValueError:
        return False
    return True


class H1Client(KeepAliveClient):
    """A keep-alive pool of HTTP/1.1 connections to plain-http upstreams."""

    def __init__(self, max_connections: int, keepalive_expiry_s: float, *, connect_s: float, headers: dict,
                 head_limits: HeadLimits | None = None):
        self.max_connections = max_connections
        self.head_limits = head_limits or HeadLimits()
        self.keepalive_expiry_s = keepalive_expiry_s
        self.connect_s = connect_s
        self.new_connections = 0
        fixed = "".join(f"{_valid(k)}: {_valid(v)}\r\n" for k, v in headers.items())
        if keepalive_expiry_s <= 0:
            fixed += "connection: close\r\n"  # the upstream closes first: no idle sockets either side
        self._fixed = fixed.encode()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._targets: dict[str, _Target] = {}
        self._in_use = 0  # slots taken: requests with a connection (or about to open one)
        self._waiters: deque[asyncio.Future] = deque()
        self._idle: dict[tuple, list[_Connection]] = {}
        self._open: set[_Connection] = set()
        self._addresses: dict[tuple, tuple[float, list]] = {}
        self._sweeper: asyncio.TimerHandle | None = None
        self._closed = False

    # -- requests --------------------------------------------------------------------------

    async def send(self, method: str, url: str, content: bytes, headers: dict) -> Response:
        """Send and wait for the answer's status and headers; a retry under the keep-alive rule
        keeps the slot of the first try. Not for HEAD requests (the parser, not knowing the
        method, would wait for a body)."""
        if self._closed:
            raise UpstreamUnreachable("the client is closed")
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        await self._acquire()
        try:
            return await super().send(method, url, content, headers)
        except BaseException:
            self._release_slot()
            raise

    async def attempt(self, method: str, url: str, content: bytes, headers: dict, *, fresh: bool) -> Response:
        """One try, in a slot already taken: on the newest idle connection unless `fresh`."""
        target = self._targets.get(url)
        if target is None:
            target = self._targets[url] = _Target(url)
        payload = target.head(method, self._fixed)
        if headers:
            payload += "".join(f"{_valid(k)}: {_valid(v)}\r\n" for k, v in headers.items()).encode()
        if content or method not in BODYLESS:
            payload += b"content-length: %d\r\n\r\n%b" % (len(content), content)
        else:
            payload += b"\r\n"
        conn = None if fresh else self._reuse(target.key)
        if conn is None:
            conn = await self._connect(target)
            conn.once = fresh  # a retry's connection serves that request only (see the rule)
        return await self._exchange(conn, payload)

    async def _exchange(self, conn: _Connection, payload: bytes) -> Response:
        if conn.lost:
            raise self._dropped(conn, "closed")
        conn.active = True
        conn.transport.write(payload)
        try:
            while not conn.head_done:
                if conn.error is not None:
                    if conn.too_large:
                        raise AnswerTooLarge(conn.error)
                    if not conn.got_bytes:
                        raise self._dropped(conn, conn.error)
                    raise UpstreamUnreachable(conn.error)
                await conn.wait()
        except BaseException:  # failed, or cancelled (the caller's deadline): never reused
            conn.close()
            raise
        return Response(conn.status, conn.headers, _Body(self, conn))

    @staticmethod
    def _dropped(conn: _Connection, why: str) -> Exception:
        """A connection failed before any response byte: a reused one in the keep-alive race (sent
        again), a new one by the upstream's doing."""
        return ReusedConnectionDropped(why) if conn.reused else UpstreamUnreachable(why)

    # -- slots: at most max_connections requests hold a connection -------------------------

    async def _acquire(self) -> None:
        if self._in_use < self.max_connections and not self._waiters:
            self._in_use += 1
            return
        waiter = self._loop.create_future()
        self._waiters.append(waiter)
        try:
            # True: `_release_slot` handed its slot over (_in_use stays as it is); False: closed.
            if not await waiter:
                raise UpstreamUnreachable("the client is closed")
        except BaseException:
            if waiter.done() and not waiter.cancelled() and waiter.result():
                self._release_slot()  # handed a slot just as it was cancelled: pass it on
            else:
                try:
                    self._waiters.remove(waiter)
                except ValueError:
                    pass
            raise

    def _release_slot(self) -> None:
        waiters = self._waiters
        while waiters:
            waiter = waiters.popleft()
            if not waiter.done():
                waiter.set_result(True)
                return
        self._in_use -= 1

    def _give_back(self, conn: _Connection) -> None:
        """The answer on `conn` is finished with: keep the connection for the next request when
        it was read to its end and allows reuse, else close it; the slot goes to the next waiter."""
        if (conn.done and conn.reusable and not conn.buf and not conn.lost and not conn.once
                and not self._closed and self.keepalive_expiry_s > 0):
            conn.reset()
            conn.reused = True
            conn.idle_since = self._loop.time()
            idle = self._idle.get(conn.key)
            if idle is None:
                idle = self._idle[conn.key] = []
            idle.append(conn)
            if self._sweeper is None:
                self._sweeper = self._loop.call_at(conn.idle_since + self.keepalive_expiry_s, self._sweep)
        else:
            conn.close()
        self._release_slot()

    # -- connections -----------------------------------------------------------------------

    def _reuse(self, key: tuple) -> _Connection | None:
        """The newest idle connection to `key` that is still open and not expired."""
        idle = self._idle.get(key)
        if not idle:
            return None
        oldest = self._loop.time() - self.keepalive_expiry_s
        while idle:
            conn = idle.pop()
            if conn.lost:
                continue
            if conn.idle_since < oldest:  # the rest are older still
                conn.close()
                for older in idle:
                    older.close()
                idle.clear()
                return None
            if conn.unread_bytes_waiting():  # an answer nobody asked for, or the upstream's close
                conn.close("unexpected data")
                continue
            return conn
        return None

    def _sweep(self) -> None:
        """Close the idle connections past their expiry, even when no request comes to reuse them."""
        self._sweeper = None
        oldest = self._loop.time() - self.keepalive_expiry_s
        next_expiry = None
        for idle in self._idle.values():
            keep = [conn for conn in idle if not conn.lost and conn.idle_since >= oldest]
            for conn in idle:
                if conn.idle_since < oldest:
                    conn.close()
            idle[:] = keep
            if keep:
                first = keep[0].idle_since + self.keepalive_expiry_s
                next_expiry = first if next_expiry is None else min(next_expiry, first)
        if next_expiry is not None and not self._closed:
            self._sweeper = self._loop.call_at(next_expiry, self._sweep)

    async def _connect(self, target: _Target) -> _Connection:
        self._make_room()
        conn = _Connection(self, target.key)
        try:
            async with asyncio.timeout(self.connect_s):
                await self._open_socket(conn, target)
        except TimeoutError:
            raise UpstreamUnreachable("ConnectionTimeoutError") from None
        except OSError as exc:
            raise UpstreamUnreachable(f"{type(exc).__name__}: {exc}") from None
        self._open.add(conn)
        self.new_connections += 1
        return conn

    async def _open_socket(self, conn: _Connection, target: _Target) -> None:
        error: OSError | None = None
        for address in await self._resolve(target):
            try:
                await self._loop.create_connection(lambda: conn, address, target.port)
                return
            except OSError as exc:
                error = exc
        self._addresses.pop(target.key, None)  # none answered: look the name up again next time
        raise error or OSError(f"no address for {target.host}")

    async def _resolve(self, target: _Target) -> list[str]:
        """The host's addresses, from a cache: a host name costs a thread's getaddrinfo per
        DNS_TTL_S, not per connection (aiohttp's DNS cache did the same)."""
        now = self._loop.time()
        cached = self._addresses.get(target.key)
        if cached is not None and cached[0] > now:
            return cached[1]
        try:
            ipaddress.ip_address(target.host)
            addresses, expires = [target.host], float("inf")
        except ValueError:
            infos = await self._loop.getaddrinfo(target.host, target.port, type=socket.SOCK_STREAM)
            addresses = list(dict.fromkeys(info[4][0] for info in infos))
            expires = now + DNS_TTL_S
        self._addresses[target.key] = (expires, addresses)
        return addresses

    def _make_room(self) -> None:
        """At most max_connections open in all: an idle connection to another host gives way."""
        if len(self._open) < self.max_connections:
            return
        for idle in self._idle.values():
            while idle:
                idle.pop(0).close()
                if len(self._open) < self.max_connections:
                    return

    def _forget(self, conn: _Connection) -> None:
        self._open.discard(conn)

    @property
    def open_connections(self) -> int:
        return len(self._open)

    async def aclose(self) -> None:
        """Close every connection; requests waiting for one fail."""
        self._closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for conn in list(self._open):
            conn.close()
        self._idle.clear()
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(False)
        await asyncio.sleep(0)  # the transports close their sockets on the next loop pass


def _valid(text: str) -> str:
    """A header name or value as given; one that could split the request head is refused (as
    aiohttp refuses it)."""
    if "\n" in text or "\r" in text:
        raise ValueError("Newline or carriage return character detected in HTTP header")
    return text
