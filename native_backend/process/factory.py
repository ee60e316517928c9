"""The engine core the engine process runs: an executor for the config, and the loop around it.

The engine process imports this module by name (`native_backend.process.factory:make_engine_core`),
inside itself, so the gateway's side never imports torch.
"""

from __future__ import annotations

import logging
import time

from native_backend.config.engine import EngineConfig
from native_backend.core.engine import LLMEngine
from native_backend.execution.factory import make_executor
from native_backend.process.kv_publisher import KVEventPublisher

log = logging.getLogger("kvgate.engine")


def make_engine_core(config: EngineConfig) -> LLMEngine:
    started = time.monotonic()
    executor = make_executor(config)
    # Bound before the engine starts, so a taken port fails start-up (and is reported) at once.
    publisher = KVEventPublisher(config.kv_events) if config.kv_events is not None else None
    engine = LLMEngine(config, executor, kv_events=publisher.publish if publisher else None)
    log.info("engine ready in %.1f s: %s", time.monotonic() - started, engine.describe())
    return engine
