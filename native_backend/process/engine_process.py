"""The engine process: builds the engine core from a factory, then steps it and talks over pipes.

    parent (AsyncEngineClient)                     this process
    writer thread ── [cmd, cmd, ...] ──> inbox ──> EngineLoop.run():
                                                     receive  (never blocks while there is work;
                                                               blocks until a command when idle)
                                                     step     (one forward pass)
                                                     send     (all outputs of the step: ONE message)
    reader thread <── (Msg, payload) ─── outbox <──  stats    (every stats_interval_s if changed,
                                                               and at least every heartbeat_s)

The messages are tuples tagged with `protocol.Msg` (listed there). The stats double as a
heartbeat: a parent that hears nothing for longer than its watchdog allows knows the process is
stopped or a step hangs, even when the engine is idle.

Only the standard library and native_backend.process.protocol are imported here: the factory's module
(and torch with it) is imported in the child, never in the parent.
"""

from __future__ import annotations

import importlib
import pickle
import signal
import sys
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from native_backend.core.interface import EngineCoreProtocol, EngineError, EngineRequest, EngineStats
from native_backend.process.protocol import Msg

HEARTBEAT_S = 1.0  # an idle engine still sends its stats this often

# A factory is a module-level callable, or "package.module:function" so the parent need not
# import the module at all.
CoreFactory = Callable[..., EngineCoreProtocol] | str


def resolve_factory(factory: CoreFactory) -> Callable[..., EngineCoreProtocol]:
    if callable(factory):
        return factory
    module_name, sep, attr = factory.partition(":")
    if not sep:
        raise ValueError(f"factory {factory!r}: expected 'package.module:function'")
    return getattr(importlib.import_module(module_name), attr)


def pack_factory(factory: CoreFactory, args: tuple, kwargs: dict[str, Any]) -> bytes:
    """Pickle the factory call in the parent, so that an unpicklable argument fails there and
    an unimportable factory fails inside run_engine_process, where it is reported."""
    return pickle.dumps((factory, args, kwargs))


def run_engine_process(packed_factory: bytes, inbox: Connection, outbox: Connection,
                       stats_interval_s: float, heartbeat_s: float = HEARTBEAT_S) -> None:
    """Entry point of the spawned process."""
    # Ctrl-C reaches the whole process group; the parent decides when the engine stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        factory, args, kwargs = pickle.loads(packed_factory)
        core = resolve_factory(factory)(*args, **kwargs)
    except BaseException as exc:  # noqa: BLE001 - anything here is a start-up failure to report
        _send_quietly(outbox, (Msg.STARTUP_FAILED, _summary(exc), traceback.format_exc()))
        sys.exit(1)
    try:
        outbox.send((Msg.READY, core.stats(), _describe(core)))  # what it runs, for the log
        EngineLoop(core, inbox, outbox, stats_interval_s, heartbeat_s).run()
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # the parent went away: nobody is left to serve
    except BaseException as exc:  # noqa: BLE001 - the core is in an unknown state: report and die
        _send_quietly(outbox, (Msg.FATAL, _summary(exc), traceback.format_exc()))
        sys.exit(1)


class EngineLoop:
    """Receive commands, step the core, send outputs; until told to shut down."""

    def __init__(self, core: EngineCoreProtocol, inbox: Connection, outbox: Connection,
                 stats_interval_s: float, heartbeat_s: float = HEARTBEAT_S):
        self.core = core
        self.inbox = inbox
        self.outbox = outbox
        self.stats_interval_s = stats_interval_s
        self.heartbeat_s = max(heartbeat_s, stats_interval_s)
        self._running = True
        self._last_stats: EngineStats | None = None
        self._next_stats_at = 0.0
        self._last_sent_at = 0.0

    def run(self) -> None:
        while self._running:
            busy = self.core.has_unfinished()
            self._receive(timeout=0.0 if busy else self._time_to_next_stats())
            if self._running and self.core.has_unfinished():
                self._step()
            self._maybe_send_stats()

    def _receive(self, timeout: float) -> None:
        """Apply every command already waiting; wait up to `timeout` for the first one."""
        while self._running and self.inbox.poll(timeout):
            for command in self.inbox.recv():
                self._apply(command)
            timeout = 0.0

    def _apply(self, command: tuple) -> None:
        tag = command[0]
        if tag is Msg.ADD:
            self._add(command[1])
        elif tag is Msg.ABORT:
            self.core.abort(command[1])
        elif tag is Msg.RELEASE_KV:
            self.core.release_kv(command[1], command[2])
        elif tag is Msg.RESET_PREFIX_CACHE:
            self.core.reset_prefix_cache()
        elif tag is Msg.LORA:
            self._lora(*command[1:])
        elif tag is Msg.SHUTDOWN:
            self._running = False
        else:
            raise ValueError(f"unknown engine command {tag!r}")

    def _add(self, request: EngineRequest) -> None:
        try:
            self.core.add_request(request)
        except EngineError as exc:
            self._send((Msg.ERROR, request.request_id, exc))
        except Exception as exc:  # noqa: BLE001 - one bad request must not take the engine down
            self.core.abort(request.request_id)  # whatever part of it got in
            self._send((Msg.ERROR, request.request_id, EngineError("internal", _summary(exc))))

    def _lora(self, op_id: int, action: str, name: str, path: str | None) -> None:
        """Load or unload an adapter between two steps; the answer names a refusal, which never
        takes the engine down (a bad adapter is the operator's mistake)."""
        try:
            if action == "load":
                self.core.add_lora(name, path)
            else:
                self.core.remove_lora(name)
        except EngineError as exc:
            self._send((Msg.LORA_DONE, op_id, exc.message))
        except Exception as exc:  # noqa: BLE001 - an unreadable adapter must not kill the engine
            self._send((Msg.LORA_DONE, op_id, _summary(exc)))
        else:
            self._send((Msg.LORA_DONE, op_id, None))

    def _step(self) -> None:
        outputs = self.core.step()
        if outputs:
            self._send((Msg.OUTPUTS, outputs))

    def _send(self, message: tuple) -> None:
        self.outbox.send(message)
        self._last_sent_at = time.monotonic()

    def _time_to_next_stats(self) -> float:
        return max(0.0, self._next_stats_at - time.monotonic())

    def _maybe_send_stats(self) -> None:
        now = time.monotonic()
        if now < self._next_stats_at:
            return
        self._next_stats_at = now + self.stats_interval_s
        stats = self.core.stats()
        # An idle engine sends only a heartbeat now and then, so the parent knows it is alive.
        if stats != self._last_stats or now - self._last_sent_at >= self.heartbeat_s:
            self._send((Msg.STATS, stats))
            self._last_stats = stats


def _summary(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _send_quietly(conn: Connection, message: tuple) -> None:
    try:
        conn.send(message)
    except (OSError, EOFError):
        pass  # the parent is gone; the exit code is all it could have learned anyway


def _describe(core) -> str | None:
    describe = getattr(core, "describe", None)
    return describe() if callable(describe) else None
