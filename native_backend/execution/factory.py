"""The executor for a config: in-process for one device, worker processes for tensor parallelism.

Apart from both executors so that neither imports the other (the workers run InProcessExecutor).
"""

from __future__ import annotations

from native_backend.config.engine import EngineConfig
from native_backend.execution.executor import Executor, InProcessExecutor
from native_backend.execution.parallel.executor import TensorParallelExecutor
from native_backend.text.tokenizer import Tokenizer


def make_executor(config: EngineConfig, tokenizer: Tokenizer | None = None) -> Executor:
    """The executor for this config: in-process for one device, worker processes for
    tensor_parallel_size > 1. `tokenizer`: the process's own (process.factory loads it once), for
    the fp8 KV calibration and the draft model's check; None: loaded from the model when needed."""
    if config.parallel.world_size > 1:  # tensor and/or pipeline parallelism
        return TensorParallelExecutor(config, tokenizer)
    return InProcessExecutor(config, tokenizer=tokenizer)
