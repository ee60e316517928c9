"""Deadlines for a request's head and body, and a cap on open connections (slowloris).

uvicorn bounds only the idle time between two requests of a kept-alive connection: a client
that sends its head, or its body, a byte at a time holds a connection (and the handler's
`request.body()`) for as long as it likes, and a few hundred such clients hold them all.
`deadline_protocol` is uvicorn's httptools protocol with three additions:

    connection ──head──> headers complete ──body──> message complete ── (app answers) ──> next head
      │ head_timeout_s from the first byte     │ body_timeout_s from the headers
      └ over max_connections: closed at once   └ late: 408 (if nothing was answered yet), closed

Each deadline is the whole span, not the gap between two bytes: a trickle cannot extend it.
"""

from __future__ import annotations

import asyncio
import json
import logging

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateway.config import ConnectionLimits, ServerConfig

log = logging.getLogger("kvgate.connections")


def uvicorn_options(server: ServerConfig) -> dict:
    """How uvicorn serves client connections: with the deadlines and cap here, and believing
    X-Forwarded-For/-Proto only from server.trusted_proxies (uvicorn's default trusts 127.0.0.1:
    anything on the gateway's host could then claim https or another client address)."""
    return {"http": deadline_protocol(server.connections), "proxy_headers": bool(server.trusted_proxies),
            "forwarded_allow_ips": ",".join(server.trusted_proxies) or None}


def deadline_protocol(limits: ConnectionLimits) -> type[asyncio.Protocol]:
    """The protocol class to give uvicorn (`http=`), bound to these limits."""
    return type("DeadlineProtocol", (DeadlineProtocol,), {"limits": limits})


def _timeout_response(what: str, seconds: float) -> bytes:
    body = json.dumps({"error": {"message": f"The request {what} did not arrive within {seconds:g} s.",
                                 "type": "invalid_request_error", "param": None, "code": "request_timeout"}}).encode()
    head = (f"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode()
    return head + body


class DeadlineProtocol(HttpToolsProtocol):
    limits: ConnectionLimits  # set by deadline_protocol
    _timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            log.warning("%d connections open, over server.connections.max_connections: a new one is closed",
                        len(self.connections) - 1)
            transport.close()
            return
        self._arm(self.limits.head_timeout_s, self._head_late)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm(self.limits.head_timeout_s, self._head_late)  # the next request on a kept-alive connection

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        self._arm(self.limits.body_timeout_s, self._body_late)

    def on_message_complete(self) -> None:
        self._disarm()
        super().on_message_complete()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self, seconds: float, callback) -> None:
        self._disarm()
        self._timer = self.loop.call_later(seconds, callback)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _head_late(self) -> None:
        self._close_late("head", self.limits.head_timeout_s, answered=False)

    def _body_late(self) -> None:
        cycle = self.cycle
        answered = cycle is not None and cycle.response_started
        if cycle is not None:  # the handler waiting in receive() sees a disconnect, and ends
            cycle.disconnected = True
            cycle.message_event.set()
        self._close_late("body", self.limits.body_timeout_s, answered=answered)

    def _close_late(self, what: str, seconds: float, answered: bool) -> None:
        self._timer = None
        if self.transport.is_closing():
            return
        log.info("%s: the request %s did not arrive within %g s; connection closed",
                 "%s:%d" % self.client if self.client else "client", what, seconds)
        if not answered:
            self.transport.write(_timeout_response(what, seconds))
        self.transport.close()
