"""The engine core the engine process runs: an executor for the config, the core around it, and
the output processor that gives it text.

The engine process imports this module by name (`native_backend.process.factory:make_engine_core`),
inside itself, so the gateway's side never imports torch. The tokenizer is loaded here, once per
engine process (a GGUF's is unpacked into the tokenizer cache, where the native plugin reads it):
the executor takes it for the fp8 KV calibration text and the draft model's vocabulary check, the
output processor detokenizes with it, and the core gets its end-of-sequence ids and a grammar
compiler bound to it (structured outputs compile against its vocabulary).
"""

from __future__ import annotations

import functools
import logging
import time

from native_backend.config.engine import EngineConfig
from native_backend.core.engine import LLMEngine
from native_backend.execution.factory import make_executor
from native_backend.execution.kv_transfer.connector import make_kv_transfer
from native_backend.execution.parallel.executor import TensorParallelExecutor
from native_backend.process.kv_publisher import KVEventPublisher
from native_backend.process.output_processor import OutputProcessor
from native_backend.text.grammar import GrammarCompiler
from native_backend.text.tokenizer import Tokenizer

log = logging.getLogger("kvgate.engine")


def make_engine_core(config: EngineConfig) -> OutputProcessor:
    started = time.monotonic()
    tokenizer = Tokenizer.from_pretrained(config.model.path, cache_dir=config.model.tokenizer_cache_dir)
    executor = make_executor(config, tokenizer)  # its fp8 calibration and draft check use this one too
    # Bound before the engine starts, so a taken port fails start-up (and is reported) at once.
    publisher = KVEventPublisher(config.kv_events) if config.kv_events is not None else None
    # Bound here, so a taken port fails start-up at once.
    kv_transfer = make_kv_transfer(config.transfer, kv_blocks(executor)) if config.transfer.kv_role else None
    core = LLMEngine(config, executor, kv_events=publisher.publish if publisher else None,
                     extra_eos_token_ids=tokenizer.eos_token_ids,
                     grammar_compiler=functools.partial(GrammarCompiler, tokenizer), kv_transfer=kv_transfer)
    if kv_transfer is not None:
        log.info("KV connector (%s): %s", config.transfer.kv_role, kv_transfer.describe())
    engine = OutputProcessor(core, tokenizer)
    log.info("engine ready in %.1f s: %s", time.monotonic() - started, engine.describe())
    return engine


def kv_blocks(executor):
    """What a KV transfer moves: under tensor parallelism every rank's blocks (rank 0's process
    holds only its own KV heads; parallel.kv_relay), else the executor's cache."""
    return executor.kv_blocks() if isinstance(executor, TensorParallelExecutor) else executor.kv_cache
