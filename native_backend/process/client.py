"""AsyncEngineClient: the gateway-side handle on an engine process.

    event loop                     threads                          engine process
    generate() ── _send ──> writer thread (batches commands) ──pipe──> EngineLoop
        ^                                                                  │
    _RequestStream <── call_soon_threadsafe ── reader thread <──pipe───────┘
    (one per request)                          (waits on the pipe and the process sentinel)

Pipe I/O lives in two threads so the event loop never blocks on it: a long prompt can fill the
pipe while the engine is busy in a forward pass, and a read must not stall other requests.

Watchdog: once ready, the engine sends something (outputs, stats, or a heartbeat) at least every
heartbeat_s. When the reader hears nothing for `watchdog_s`, the process is stopped or a step
hangs: the reader kills it, and the exit is handled like any other death (every in-flight
request fails with EngineDeadError naming the cause, `on_exit` is called). Restarting is the
owner's decision (the native plugin's supervisor).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import multiprocessing
import multiprocessing.connection
import multiprocessing.util
import queue
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from native_backend.core.interface import EngineRequest, EngineStats, RequestOutput
from native_backend.process.engine_process import HEARTBEAT_S, CoreFactory, pack_factory, run_engine_process
from native_backend.process.protocol import EngineDeadError, EngineStartupError, LoRARefused, Msg

logger = logging.getLogger(__name__)

_STOP_WRITER = object()


class AsyncEngineClient:
    """Starts the engine core in a spawned process and streams its outputs to asyncio callers.

    Not thread-safe: use it from the event loop that called start().
    """

    def __init__(
        self,
        factory: CoreFactory,
        factory_args: tuple = (),
        factory_kwargs: dict[str, Any] | None = None,
        *,
        startup_timeout_s: float = 600.0,  # loading weights and warming up can take minutes
        stats_interval_s: float = 0.25,
        process_name: str = "kvgate-engine",
        watchdog_s: float | None = None,  # silence after which a ready engine counts as hung
        heartbeat_s: float = HEARTBEAT_S,
        on_exit: Callable[[str], None] | None = None,  # called in the loop with the cause of death
    ):
        if watchdog_s is not None and watchdog_s <= max(heartbeat_s, stats_interval_s):
            raise ValueError("watchdog_s must be longer than the engine's heartbeat")
        self._factory = factory
        self._factory_args = factory_args
        self._factory_kwargs = factory_kwargs or {}
        self._startup_timeout_s = startup_timeout_s
        self._stats_interval_s = stats_interval_s
        self._process_name = process_name
        self._watchdog_s = watchdog_s
        self._heartbeat_s = heartbeat_s
        self._on_exit = on_exit
        self._exit_reported = False
        self._heard_ready = False  # set by the reader thread: the watchdog runs from then on
        self.last_heard = time.monotonic()
        self.description: str | None = None  # what the engine runs (from its ready message)

        self._process: multiprocessing.process.BaseProcess | None = None
        self._to_engine: multiprocessing.connection.Connection | None = None
        self._from_engine: multiprocessing.connection.Connection | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready: asyncio.Future | None = None

        self._streams: dict[str, _RequestStream] = {}
        self._lora_ops: dict[int, asyncio.Future] = {}  # LoRA loads/unloads the engine has not answered
        self._next_op = 0
        self._stats = EngineStats()
        self._alive = False
        self._death_reason: str | None = None

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Spawn the engine process and wait until its core is built (or raise EngineStartupError)."""
        if self._process is not None:
            raise RuntimeError("engine client already started")
        self._loop = asyncio.get_running_loop()
        self._ready = self._loop.create_future()
        ctx = multiprocessing.get_context("spawn")
        engine_inbox, self._to_engine = ctx.Pipe(duplex=False)
        self._from_engine, engine_outbox = ctx.Pipe(duplex=False)
        self._process = ctx.Process(
            target=run_engine_process,
            args=(pack_factory(self._factory, self._factory_args, self._factory_kwargs),
                  engine_inbox, engine_outbox, self._stats_interval_s, self._heartbeat_s),
            name=self._process_name,
            daemon=False,  # a daemonic process may not start its own workers (e.g. tensor parallel)
        )
        await asyncio.to_thread(self._process.start)
        # Drop our copies of the engine's ends: once the engine exits, reads here see EOF.
        engine_inbox.close()
        engine_outbox.close()
        # If the interpreter exits without shutdown(), stop the engine before multiprocessing's
        # exit handler joins it (it would wait forever for an engine waiting on us).
        multiprocessing.util.Finalize(self, _stop_process, (self._process, self._to_engine),
                                      exitpriority=10)
        self._alive = True
        self._start_thread(self._read_loop, "reader")
        self._start_thread(self._write_loop, "writer")
        await self._wait_until_ready()

    async def _wait_until_ready(self) -> None:
        try:
            self._stats = await asyncio.wait_for(asyncio.shield(self._ready), self._startup_timeout_s)
        except TimeoutError:
            self._death_reason = f"engine did not start within {self._startup_timeout_s:g} s"
            self._ready.cancel()  # nobody will wait for it any more
            await self._stop(kill=True)
            raise EngineStartupError(self._death_reason) from None
        except BaseException:
            await self._stop(kill=True)
            raise

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the engine; in-flight requests fail with EngineDeadError."""
        if self._process is None:
            return
        self._death_reason = self._death_reason or "engine was shut down"
        self._send((Msg.SHUTDOWN,))
        await self._stop(kill=False, timeout_s=timeout_s)

    async def _stop(self, kill: bool, timeout_s: float = 5.0) -> None:
        process = self._process
        self._commands.put(_STOP_WRITER)
        if kill and process.is_alive():
            process.kill()
        await asyncio.to_thread(process.join, timeout_s)
        if process.is_alive():
            logger.warning("engine process %s ignored shutdown; killing it", process.pid)
            process.kill()
            await asyncio.to_thread(process.join, timeout_s)
        for thread in self._threads:
            await asyncio.to_thread(thread.join, timeout_s)
        self._on_engine_exit()
        self._to_engine.close()
        self._from_engine.close()

    @property
    def is_alive(self) -> bool:
        return self._alive

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    @property
    def death_reason(self) -> str | None:
        return self._death_reason

    @property
    def in_flight(self) -> int:
        return len(self._streams)

    def stats(self) -> EngineStats:
        """The engine's latest stats snapshot (no I/O; at most stats_interval_s old while busy)."""
        return self._stats

    # ------------------------------------------------------------------ requests

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Submit a request and yield its outputs until one is finished.

        Outputs that queued up while the consumer was busy arrive merged into one delta.
        Raises EngineError if the engine refuses the request, EngineDeadError if the engine dies.
        Leaving the iteration early (break, cancellation, an exception) aborts the request;
        use `contextlib.aclosing(client.generate(...))` to make that immediate after a break.
        """
        self._check_accepting()
        request_id = request.request_id
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in flight")
        stream = _RequestStream()
        self._streams[request_id] = stream
        self._send((Msg.ADD, request))
        try:
            while True:
                output, error = _coalesce(await stream.take_all())
                if error is not None or (output is not None and output.finished):
                    self._streams.pop(request_id, None)  # over: nothing left to abort
                if output is not None:
                    yield output
                if error is not None:
                    raise error
                if output is not None and output.finished:
                    return
        finally:
            if self._streams.get(request_id) is stream:  # the consumer left before the end
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Stop a request: the engine frees it and its generate() ends with finish_reason 'abort'."""
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return
        stream.put(RequestOutput(request_id, [], "", finish_reason="abort"))
        if self._alive:
            self._send((Msg.ABORT, request_id))

    def release_kv(self, engine_id: str, request_id: str) -> None:
        """Have a producer engine free the KV blocks it holds for `request_id` (a finished prefill
        no decode engine will read: prefill/decode disaggregation). Not a request of this client's
        any more, so no stream is touched; a dead engine holds nothing."""
        if self._alive:
            self._send((Msg.RELEASE_KV, engine_id, request_id))

    def reset_prefix_cache(self) -> None:
        """Have the engine forget every cached prefix (between two steps; running requests keep
        their KV) and publish AllBlocksCleared on its KV-event stream."""
        self._check_accepting()
        self._send((Msg.RESET_PREFIX_CACHE,))

    async def load_lora(self, name: str, path: str) -> None:
        """Load a LoRA adapter into the engine (between two steps). Raises LoRARefused with the
        engine's reason (a missing file, a shape that does not fit, ...), EngineDeadError if it dies."""
        await self._lora_op("load", name, path)

    async def unload_lora(self, name: str) -> None:
        """Unload an adapter; LoRARefused when it is not loaded or unfinished requests use it."""
        await self._lora_op("unload", name, None)

    async def _lora_op(self, action: str, name: str, path: str | None) -> None:
        self._check_accepting()
        self._next_op += 1
        op_id, done = self._next_op, self._loop.create_future()
        self._lora_ops[op_id] = done
        self._send((Msg.LORA, op_id, action, name, path))
        try:
            refusal = await done
        finally:
            self._lora_ops.pop(op_id, None)
        if refusal is not None:
            raise LoRARefused(refusal)

    def _check_accepting(self) -> None:
        if self._alive and self._ready is not None and self._ready.done():
            return
        if self._process is None:
            raise RuntimeError("engine client not started: call start() first")
        raise EngineDeadError(self._death_reason or "engine is still starting")

    def _send(self, command: tuple) -> None:
        self._commands.put(command)

    # ------------------------------------------------------------------ engine -> client

    def _dispatch(self, messages: list[tuple]) -> None:
        """Runs in the event loop: route each engine message."""
        for message in messages:
            tag = message[0]
            if tag is Msg.OUTPUTS:
                for output in message[1]:
                    self._route_output(output)
            elif tag is Msg.ERROR:
                stream = self._streams.pop(message[1], None)
                if stream is not None:
                    stream.put(message[2])
            elif tag is Msg.LORA_DONE:
                done = self._lora_ops.get(message[1])
                if done is not None and not done.done():
                    done.set_result(message[2])
            elif tag is Msg.STATS:
                self._stats = message[1]
            elif tag is Msg.READY:
                self.description = message[2]
                if not self._ready.done():
                    self._ready.set_result(message[1])
            elif tag is Msg.STARTUP_FAILED:
                self._death_reason = f"engine failed to start: {message[1]}"
                logger.error("%s\n%s", self._death_reason, message[2])
                if not self._ready.done():
                    self._ready.set_exception(EngineStartupError(self._death_reason))
            elif tag is Msg.FATAL:
                self._death_reason = f"engine crashed: {message[1]}"
                logger.error("%s\n%s", self._death_reason, message[2])

    def _route_output(self, output: RequestOutput) -> None:
        stream = self._streams.get(output.request_id)
        if stream is None:
            return  # aborted here, the engine had not heard yet
        if output.error is not None:  # the request failed alone: its consumer gets the error
            del self._streams[output.request_id]
            if output.new_token_ids or output.new_text:
                stream.put(_without_error(output))
            stream.put(output.error)
        else:
            stream.put(output)

    def _on_engine_exit(self) -> None:
        """Runs in the event loop once the engine is gone (idempotent): fail everything in flight."""
        self._alive = False
        self._commands.put(_STOP_WRITER)
        reason = self._death_reason or f"engine process died: {_describe_exit(self._process)}"
        self._death_reason = reason
        if not self._ready.done():
            self._ready.set_exception(EngineStartupError(f"engine process exited before it was ready: {reason}"))
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.put(EngineDeadError(reason))
        for done in self._lora_ops.values():
            if not done.done():
                done.set_exception(EngineDeadError(reason))
        if self._on_exit is not None and not self._exit_reported:
            self._exit_reported = True
            self._on_exit(reason)

    # ------------------------------------------------------------------ threads

    def _start_thread(self, target, role: str) -> None:
        thread = threading.Thread(target=target, name=f"{self._process_name}-{role}", daemon=True)
        thread.start()
        self._threads.append(thread)

    def _read_loop(self) -> None:
        """Reader thread: hand each burst of engine messages to the loop in one callback."""
        conn, sentinel = self._from_engine, self._process.sentinel
        try:
            while True:
                timeout = self._watchdog_s if self._heard_ready else None
                ready = multiprocessing.connection.wait([conn, sentinel], timeout)
                if not ready:
                    self._kill_hung()
                    break
                if conn not in ready:
                    break  # the process ended and nothing is left to read
                messages = [conn.recv()]
                while conn.poll(0):
                    messages.append(conn.recv())
                self.last_heard = time.monotonic()
                self._heard_ready |= any(m[0] is Msg.READY for m in messages)
                self._call_in_loop(self._dispatch, messages)
        except (EOFError, OSError):
            pass  # the engine closed its end: it exited or died
        self._process.join(1.0)  # so the exit code can say how it ended
        self._call_in_loop(self._on_engine_exit)

    def _kill_hung(self) -> None:
        """Reader thread: the engine said nothing for watchdog_s (stopped, or a step hangs)."""
        reason = f"engine hung: no word from it for {self._watchdog_s:g} s (watchdog); killed"
        self._death_reason = self._death_reason or reason
        logger.error("engine process %s: %s", self._process.pid, reason)
        self._process.kill()  # SIGKILL works on a stopped process too
        self._process.join(5.0)

    def _write_loop(self) -> None:
        """Writer thread: send queued commands, batching whatever piled up into one message."""
        while True:
            batch = [self._commands.get()]
            while not self._commands.empty():
                batch.append(self._commands.get())
            stop = any(command is _STOP_WRITER for command in batch)
            commands = [command for command in batch if command is not _STOP_WRITER]
            try:
                if commands:
                    self._to_engine.send(commands)
            except (OSError, ValueError):
                return  # the engine is gone (the reader reports it) or we closed the pipe
            if stop:
                return

    def _call_in_loop(self, callback, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:
            pass  # the loop is closed: nobody is waiting any more


class _RequestStream:
    """Items for one request: RequestOutputs, or an exception that ends the request.

    A deque plus an Event rather than an asyncio.Queue so the consumer takes everything that
    arrived since it last looked in one wake-up.
    """

    __slots__ = ("_items", "_ready")

    def __init__(self) -> None:
        self._items: collections.deque = collections.deque()
        self._ready = asyncio.Event()

    def put(self, item: RequestOutput | BaseException) -> None:
        self._items.append(item)
        self._ready.set()

    async def take_all(self) -> list[RequestOutput | BaseException]:
        await self._ready.wait()
        self._ready.clear()
        items = list(self._items)
        self._items.clear()
        return items


def _coalesce(items: list) -> tuple[RequestOutput | None, BaseException | None]:
    """Merge a burst of deltas into one output; stop at an exception or a finished output."""
    merged: RequestOutput | None = None
    for item in items:
        if isinstance(item, BaseException):
            return merged, item
        merged = item if merged is None else _merge(merged, item)
        if merged.finished:
            break  # nothing after a finished output belongs to this request
    return merged, None


def _without_error(output: RequestOutput) -> RequestOutput:
    """The text a failing request produced in its last step, as an unfinished delta."""
    return RequestOutput(output.request_id, output.new_token_ids, output.new_text,
                         logprobs=output.logprobs, num_prompt_tokens=output.num_prompt_tokens,
                         num_output_tokens=output.num_output_tokens)


def _merge(earlier: RequestOutput, later: RequestOutput) -> RequestOutput:
    logprobs = None
    if earlier.logprobs is not None or later.logprobs is not None:
        logprobs = (earlier.logprobs or []) + (later.logprobs or [])
    return RequestOutput(
        request_id=later.request_id,
        new_token_ids=earlier.new_token_ids + later.new_token_ids,
        new_text=earlier.new_text + later.new_text,
        finish_reason=later.finish_reason,
        logprobs=logprobs,
        num_prompt_tokens=later.num_prompt_tokens,
        num_cached_tokens=later.num_cached_tokens,
        num_output_tokens=later.num_output_tokens,
        timings=later.timings,
    )


def _describe_exit(process: multiprocessing.process.BaseProcess) -> str:
    code = process.exitcode
    if code is None:
        return "it closed its connection"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _stop_process(process: multiprocessing.process.BaseProcess, to_engine) -> None:
    """Interpreter-exit fallback: closing the pipe makes the engine exit; kill it if it lingers."""
    to_engine.close()
    process.join(5.0)
    if process.is_alive():
        process.kill()
        process.join(5.0)
