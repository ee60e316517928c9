"""What the `openai` backend sends through: one small protocol over its two HTTP clients.

    pool.ClientPool ── plain http, no proxy ──> h1.H1Client            (our own; the hot path)
         │         └── https, proxies ───────> aiohttp_client.AiohttpClient
         └── every answer is a `Response`, its body read through the client's `Body`

A client is a `KeepAliveClient`: it makes one `attempt` at a request, and the keep-alive retry
rule below (written here only) decides whether a second one is made. The errors are the same
whichever client sent: the backend never learns which one did.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Protocol

log = logging.getLogger("kvgate.openai")


class UpstreamUnreachable(Exception):
    """The request could not be sent or got no response: connect failed, connection dropped."""


class StreamBroken(Exception):
    """The response body broke off (reset, truncated, malformed framing)."""


class AnswerTooLarge(StreamBroken):
    """An answer over one of our bounds (its head's size or count of headers); the message says which."""


class ReusedConnectionDropped(Exception):
    """A reused connection failed before any response byte: the upstream closed it as we reused
    it (the keep-alive race). Only `KeepAliveClient.send` sees it: it sends the request again."""


class Body(Protocol):
    """An answer's body as one client reads it."""

    def complete(self) -> bool:
        """The whole body has arrived (reading it cannot wait)."""

    def chunks(self) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive; StreamBroken when it breaks off."""

    def close(self) -> None:
        """Give the connection back when the body was read to its end; otherwise close it, which
        is also how an upstream learns that a request was aborted."""


class Response:
    """An upstream's answer, whichever client brought it: status and headers (looked up without
    regard to case), the body as it arrives."""

    __slots__ = ("status_code", "headers", "body", "complete", "aiter_bytes")

    def __init__(self, status_code: int, headers, body: Body):
        self.status_code = status_code
        self.headers = headers
        self.body = body
        # The body's own methods, not methods of ours that call them: a call less each on the
        # hot path. complete(): the whole body has arrived (reading it cannot wait);
        # aiter_bytes(): its bytes as they arrive.
        self.complete = body.complete
        self.aiter_bytes = body.chunks

    async def aclose(self) -> None:
        """Give the connection back when the body was read to its end; otherwise close it, which
        is also how an upstream learns that a request was aborted."""
        self.body.close()


class KeepAliveClient:
    """An HTTP client with a keep-alive pool, and the one retry rule both clients keep.

    The rule: a request sent on a reused connection that fails before any response byte (the
    upstream closed the idle connection as we reused it) is sent once more, on a new connection
    that serves that request only (the upstream that closed one idle connection under us may be
    closing the others). A POST that never got a response byte was never run, so one retry is
    safe; a new connection that fails is the upstream's doing, and is not retried. (aiohttp's
    own retry covers idempotent methods only.)

    A subclass makes one try in `attempt`: `fresh=False` may use an idle connection and raise
    ReusedConnectionDropped when that one dropped the request; `fresh=True` opens a new one.
    """

    reuse_retries = 0  # requests sent once more under the rule

    async def send(self, method: str, url: str, content: bytes, headers: dict) -> Response:
        """Send, and wait for the answer's status and headers."""
        try:
            return await self.attempt(method, url, content, headers, fresh=False)
        except ReusedConnectionDropped as exc:
            self.reuse_retries += 1
            log.info("%s: a reused connection closed under a request (%s); retrying on a new connection", url, exc)
        return await self.attempt(method, url, content, headers, fresh=True)

    async def attempt(self, method: str, url: str, content: bytes, headers: dict, *, fresh: bool) -> Response:
        raise NotImplementedError

    async def aclose(self) -> None:
        raise NotImplementedError
