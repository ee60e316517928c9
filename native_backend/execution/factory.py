"""The executor for a config: in-process for one device, worker processes for tensor parallelism.

Apart from both executors so that neither imports the other (the workers run InProcessExecutor).
"""

from __future__ import annotations

from native_backend.config.engine import EngineConfig
from native_backend.execution.executor import Executor, InProcessExecutor
from native_backend.execution.parallel.executor import TensorParallelExecutor


def make_executor(config: EngineConfig) -> Executor:
    """The executor for this config: in-process for one device, worker processes for
    tensor_parallel_size > 1."""
    if config.parallel.tensor_parallel_size > 1:
        return TensorParallelExecutor(config)
    return InProcessExecutor(config)
