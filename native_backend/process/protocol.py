"""The messages between the gateway's side and the engine process, and the process's own failures.

    gateway process                                    engine process
    AsyncEngineClient ── EngineRequest / abort ──────> engine loop ──> EngineCore.add_request/abort
                      ── release_kv (held blocks) ───>                 EngineCore.release_kv
                      <── [RequestOutput, ...] per step ─            <── EngineCore.step()
                      <── EngineError (request refused, or failed alone mid-way)
                      <── EngineStats snapshot (periodic; a heartbeat when idle)

The data inside the messages is the engine core's (core.interface); everything pickles cheaply and
imports nothing heavy (no torch), so the gateway side can use it without loading the engine.
"""

from __future__ import annotations

import enum


class Msg(enum.Enum):
    """What crosses the pipes. Each message is a tuple whose first item is one of these.

    parent -> engine (sent in lists, so a burst costs one pipe write):
        (ADD, EngineRequest) | (ABORT, request_id) | (RELEASE_KV, engine_id, request_id)
        | (RESET_PREFIX_CACHE,) | (LORA, op_id, "load" | "unload", name, path) | (SHUTDOWN,)
    engine -> parent:
        (READY, EngineStats, description) | (STARTUP_FAILED, summary, traceback)
        | (OUTPUTS, [RequestOutput, ...]) | (ERROR, request_id, EngineError)
        | (STATS, EngineStats) | (FATAL, summary, traceback)
        | (LORA_DONE, op_id, None or the refusal's message)
    """

    ADD = enum.auto()
    ABORT = enum.auto()
    RELEASE_KV = enum.auto()
    RESET_PREFIX_CACHE = enum.auto()
    LORA = enum.auto()
    SHUTDOWN = enum.auto()
    READY = enum.auto()
    STARTUP_FAILED = enum.auto()
    OUTPUTS = enum.auto()
    ERROR = enum.auto()
    STATS = enum.auto()
    FATAL = enum.auto()
    LORA_DONE = enum.auto()


class EngineDeadError(RuntimeError):
    """The engine process is gone: in-flight requests failed and new ones are refused."""


class EngineStartupError(RuntimeError):
    """The engine process could not be started (its factory raised, it died, or it timed out)."""


class LoRARefused(ValueError):
    """The engine refused a LoRA load or unload; the message says why (it names the adapter)."""
