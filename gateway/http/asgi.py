"""Pure-ASGI pieces: the body-size limit, error rendering (in Anthropic's shape on its paths), and
disconnect-aware responses."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import AsyncIterator, Awaitable, Callable

from gateway.errors import APIError, Overloaded, RequestTooLarge

log = logging.getLogger("kvgate.asgi")


async def send_error(send, error: APIError) -> None:
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in error.headers.items()]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class BodyLimitMiddleware:
    """Refuses bodies over `max_bytes` with 413, before reading them whole.

    A declared Content-Length over the limit is refused at once; a chunked body is counted as it
    arrives and refused as soon as it passes the limit.
    """

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await send_error(send, self._too_large())
        received = 0

        async def counting_receive():
            # Raised inside the app's body read, so its APIError handler answers 413.
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise self._too_large()
            return message

        await self.app(scope, counting_receive, send)

    def _too_large(self) -> RequestTooLarge:
        return RequestTooLarge(f"The request body is over this server's limit of {self.max_bytes} bytes.")


class AnthropicErrors:
    """Error answers on Anthropic's API paths in Anthropic's shape (`{"type": "error", "error":
    {"type", "message"}}`), whichever layer answered (key check, body limit, router, endpoint):
    each renders OpenAI's shape, rewritten here. Other paths pass straight through."""

    def __init__(self, app, paths: frozenset[str]):
        self.app = app
        self.paths = paths

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] not in self.paths:
            return await self.app(scope, receive, send)
        start: dict | None = None
        body: list[bytes] = []

        async def rewriting_send(message):
            nonlocal start
            if message["type"] == "http.response.start" and message["status"] >= 400:
                start = message  # held until the body is whole
            elif start is not None and message["type"] == "http.response.body":
                body.append(message.get("body", b""))
                if not message.get("more_body"):
                    await _send_rewritten(send, start, b"".join(body))
            else:
                await send(message)

        await self.app(scope, receive, rewriting_send)


async def _send_rewritten(send, start: dict, raw: bytes) -> None:
    from gateway.translate.anthropic import error_body

    try:
        error = json.loads(raw)["error"]
        raw = json.dumps(error_body(start["status"], error["message"])).encode()
    except (ValueError, KeyError, TypeError):
        pass  # not an error body (a 499's empty answer): as it was
    headers = [(k, v) for k, v in start["headers"] if k.lower() != b"content-length"]
    headers.append((b"content-length", str(len(raw)).encode()))
    await send({**start, "headers": headers})
    await send({"type": "http.response.body", "body": raw})


async def wait_for_disconnect(receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


def watch_disconnect(receive) -> asyncio.Task:
    """A task that ends when the client disconnects: one can serve several `run_until_disconnect`
    calls of one request (a stream's opening, then its body), cancelled by whoever made it."""
    return asyncio.create_task(wait_for_disconnect(receive))


async def run_until_disconnect(receive, work: Awaitable, orphan: Callable[[object], Awaitable] | None = None,
                               watcher: asyncio.Task | None = None):
    """Run `work`; if the client disconnects first, cancel it (its cleanup aborts backends).
    `watcher`: a `watch_disconnect` task to reuse (the caller cancels it); by default one is
    made and cancelled here.

    Cancelling does not always stop work: code that swallows the cancellation (asyncio.wait_for
    returning a result that was ready at that moment) can finish anyway. Such a result is handed
    to `orphan`, so what it holds is released. Returns (finished, result)."""
    work_task = asyncio.ensure_future(work)
    own_watcher = watcher is None
    if own_watcher:
        watcher = watch_disconnect(receive)
    try:
        await asyncio.wait({work_task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        # We are cancelled ourselves (the server's shutdown ran out of time): stop the work too,
        # so its cleanup runs (backends are aborted) before the cancellation goes on.
        await _stop(work_task, orphan)
        raise
    finally:
        if own_watcher:
            watcher.cancel()
    if work_task.done():
        return True, work_task.result()
    await _stop(work_task, orphan)
    return False, None


async def _stop(work_task: asyncio.Future, orphan) -> None:
    work_task.cancel()
    await asyncio.gather(work_task, return_exceptions=True)
    if orphan is not None and not work_task.cancelled() and work_task.exception() is None:
        await asyncio.shield(orphan(work_task.result()))

class EventStreamResponse:
    """An SSE response that stops its producer as soon as the client goes away.

    Starlette's StreamingResponse only notices a disconnect on the next write under newer ASGI
    servers; a stalled backend would then never be aborted. Here a watcher task cancels the
    producer the moment `http.disconnect` arrives.
    """

    def __init__(self, chunks: AsyncIterator[bytes], headers: dict[str, str] | None = None,
                 tracker: set | None = None, finalizer: Callable[[], Awaitable | None] | None = None,
                 watcher: asyncio.Task | None = None):
        self.chunks = chunks
        self.headers = {"content-type": "text/event-stream", "cache-control": "no-cache", **(headers or {})}
        self.tracker = tracker  # the tasks serving streams: shutdown waits for their last words
        # Runs whatever happened: a producer cancelled before its first step never runs its own
        # `finally`, so what it holds (backend slots) must be freed from here too. It returns
        # None when nothing is left to free (no shielded task for that, the usual case).
        self.finalizer = finalizer
        self.watcher = watcher  # the request's disconnect watcher, if it has one already: ours now

    async def __call__(self, scope, receive, send):
        task = asyncio.current_task()
        if self.tracker is not None:
            self.tracker.add(task)
        try:
            await self._serve(receive, send)
        finally:
            if self.watcher is not None:
                self.watcher.cancel()
            if self.tracker is not None:
                self.tracker.discard(task)
            pending = self.finalizer() if self.finalizer is not None else None
            if pending is not None:
                await asyncio.shield(pending)

    async def _serve(self, receive, send):
        raw_headers = [(k.encode(), v.encode()) for k, v in self.headers.items()]
        await send({"type": "http.response.start", "status": 200, "headers": raw_headers})

        async def pump():
            writes = coalesced_until_end(self.chunks)
            try:
                last = False
                async for body, last in writes:  # the last write ends the body: one send less
                    await send({"type": "http.response.body", "body": body, "more_body": not last})
                if not last:
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
            finally:
                await writes.aclose()  # stops its producer now, not when the generator is collected
                await self.chunks.aclose()

        try:
            finished, _ = await run_until_disconnect(receive, pump(), watcher=self.watcher)
        except OSError:
            finished = False  # the socket died under a write: the same as a disconnect
        except asyncio.CancelledError:
            await _say_shutting_down(send)
            raise
        if not finished:
            log.info("client disconnected mid-stream; generation aborted")


# A slow reader holds at most this much of a stream in the gateway before its producer waits.
COALESCE_MAX_BYTES = 64 * 1024


async def coalesced_until_end(chunks: AsyncIterator[bytes],
                              max_bytes: int = COALESCE_MAX_BYTES) -> AsyncIterator[tuple[bytes, bool]]:
    """(write, whether it is the last) pairs: each write carries every chunk made while the last
    one was being sent. A write is known to be the last when the producer had ended before it
    was handed on; otherwise the stream ends with no last-marked write.

    A producer task reads `chunks` into a buffer; this generator hands the buffer on, joined,
    whenever it is not empty. When one read from a backend holds several events, or the
    client's socket is slower than the backend, they leave in one write instead of one each
    (each write is a syscall and a pass through every middleware's `send`). The first chunk is
    never held back: a waiting writer takes it the moment it exists. Errors of the producer are
    raised here, after what it made before them."""
    buffer: list[bytes] = []
    buffered = 0
    ready, room = asyncio.Event(), asyncio.Event()
    room.set()
    finished = False

    async def produce():
        nonlocal buffered, finished
        try:
            async for chunk in chunks:
                buffer.append(chunk)
                buffered += len(chunk)
                ready.set()
                if buffered >= max_bytes:
                    room.clear()
                    await room.wait()
        finally:
            finished = True
            ready.set()

    producer = asyncio.create_task(produce())
    try:
        while buffer or not finished:
            await ready.wait()
            ready.clear()
            if buffer:
                body = buffer[0] if len(buffer) == 1 else b"".join(buffer)
                buffer.clear()
                buffered = 0
                room.set()
                last = producer.done() and not producer.cancelled() and producer.exception() is None
                yield body, last
        await producer  # raises what the producer raised
    finally:
        if not producer.done():
            producer.cancel()
            await asyncio.gather(producer, return_exceptions=True)


async def _say_shutting_down(send) -> None:
    """End a stream cut by shutdown with one error event and [DONE], not a truncated body."""
    error = Overloaded("The server is shutting down; the stream was cut. Retry the request.", retry_after_s=1)
    body = b"data: " + json.dumps(error.body()).encode() + b"\n\n" + b"data: [DONE]\n\n"
    try:
        await send({"type": "http.response.body", "body": body, "more_body": False})
    except Exception:  # noqa: BLE001 - the connection may be gone already
        log.debug("could not tell a client that its stream was cut", exc_info=True)
