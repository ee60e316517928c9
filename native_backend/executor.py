"""The executor: everything between the engine core and the model on its device(s).

    engine core ── SchedulerOutput ──> Executor.execute() ──> RunnerOutput
                                          │ builds the model in its final form (LayerContext),
                                          │ sizes and allocates the KV cache, runs the ModelRunner
                                          └─ tensor parallelism: rank 0 here, ranks 1..N-1 in worker
                                             processes that receive each step's SchedulerOutput

The engine core never touches the model: what it needs to know (the model's shape, the context
length, the cache plan) comes from the executor as plain data.
"""

from __future__ import annotations

import logging
from typing import Protocol

import torch

from native_backend.batch import RunnerOutput, SchedulerOutput
from native_backend.config import ModelConfig
from native_backend.engine_config import EngineConfig
from native_backend import kv_scales
from native_backend.kv_cache import KVCache, KVCachePlan, device_memory_bytes, plan_kv_cache, resolve_kv_dtype
from native_backend.layers.context import LayerContext
from native_backend.loader import load_model
from native_backend.model_runner import ModelRunner
from native_backend.quantization.method import describe_weights
from native_backend.spec_decode import draft_model

log = logging.getLogger("kvgate.engine")

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ACTIVATION_RESERVE_BYTES = 512 << 20  # CUDA: room for activations and the allocator's slack


class Executor(Protocol):
    model_config: ModelConfig
    max_model_len: int
    plan: KVCachePlan

    def execute(self, scheduled: SchedulerOutput) -> RunnerOutput: ...

    def describe(self) -> str: ...


class InProcessExecutor:
    """One device, in the engine process: the whole model and the whole cache."""

    def __init__(self, config: EngineConfig):
        mc = config.model
        if mc.num_threads:
            torch.set_num_threads(mc.num_threads)
        self.config = config
        self.device = torch.device(mc.device)
        self.ctx = LayerContext.for_device(self.device, TORCH_DTYPES[mc.dtype], cpu_kernels=mc.cpu_kernels)
        self.model = load_model(mc.path, self.ctx)
        self.draft_model = draft_model.load_separate_draft(config, self.model, self.ctx)  # None: no own-KV draft
        self.model_config: ModelConfig = self.model.config
        limit = config.scheduler.max_model_len or self.model_config.max_position_embeddings
        self.max_model_len = min(limit, self.model_config.max_position_embeddings)
        self.kv_dtype = resolve_kv_dtype(config.kv_cache_dtype)
        self.plan = draft_model.leave_room_for_draft(self._plan_kv_cache(), draft_model.draft_kv_bytes_per_token(
            self.draft_model, TORCH_DTYPES[mc.dtype]))
        scales = self._fp8_scales() if self.kv_dtype.scaling == "per_layer" else None
        self.kv_cache = KVCache.for_model(self.model_config, num_blocks=self.plan.num_blocks,
                                          block_size=config.cache.block_size, dtype=self.kv_dtype, device=self.device)
        if scales is not None:
            kv_scales.apply(self.kv_cache, scales)
        drafter = draft_model.make_drafter(config, self.model, self.kv_cache, self.draft_model, self.device, mc.dtype)
        self.runner = ModelRunner(self.model, self.kv_cache, self.device, drafter=drafter)

    def execute(self, scheduled: SchedulerOutput) -> RunnerOutput:
        return self.runner.execute(scheduled)

    def describe(self) -> str:
        p, mc = self.plan, self.config.model
        fp32_per_token = self.plan.bytes_per_token if self.kv_dtype.name == "float32" else (
            2 * self.model_config.num_layers * self.model_config.num_kv_heads * self.model_config.head_dim * 4)
        return (f"{mc.path} on {self.device} ({mc.dtype}, {self.model.ctx.kernels}); {describe_weights(self.model)}; "
                f"KV cache {self.kv_dtype.name} {p.kv_cache_bytes / 2**20:.0f} MiB = "
                f"{p.num_blocks} blocks x {p.block_size} tokens ({p.bytes_per_token} B/token, "
                f"{fp32_per_token / p.bytes_per_token:.2f}x the tokens of float32), "
                f"{p.full_context_sequences} sequences at full context {p.max_model_len}")

    def _fp8_scales(self) -> list[tuple[float, float]]:
        """The checkpoint's per-layer scales, else a calibration pass's; 1.0 only when asked."""
        mode = self.config.cache.kv_scales
        if mode == "unit":
            log.warning("fp8 KV cache with unit scales (kv_scales: unit): values beyond %g are clipped",
                        self.kv_dtype.max_value)
            return [(1.0, 1.0)] * self.model_config.num_layers
        scales = self.model.kv_scales_from_checkpoint() if mode == "auto" else None
        source = "the checkpoint"
        if scales is None:
            from native_backend.tokenizer import Tokenizer

            mc = self.config.model
            tokenizer = Tokenizer.from_pretrained(mc.path, cache_dir=mc.tokenizer_cache_dir)
            ids = tokenizer.encode(kv_scales.calibration_text())[: min(kv_scales.CALIBRATION_TOKENS,
                                                                        self.max_model_len)]
            scales = kv_scales.calibrate(self.model, ids, self.kv_dtype, self.device)
            source = f"calibration over {len(ids)} tokens"
        log.info("fp8 KV scales from %s: %s", source, kv_scales.describe(scales))
        return scales

    def _plan_kv_cache(self) -> KVCachePlan:
        mc, cache = self.model_config, self.config.cache
        kv_dtype = resolve_kv_dtype(self.config.kv_cache_dtype)
        common = dict(num_layers=mc.num_layers, num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim,
                      bytes_per_element=kv_dtype.bytes_per_element,
                      scale_bytes_per_head=kv_dtype.scale_bytes_per_head, block_size=cache.block_size,
                      max_model_len=self.max_model_len)
        if cache.kv_cache_bytes is not None or self.device.type == "cpu":
            return plan_kv_cache(kv_cache_bytes=cache.kv_cache_bytes or cache.cpu_kv_cache_bytes, **common)
        weights = sum(t.numel() * t.element_size() for t in self.model.parameters())
        return plan_kv_cache(memory_fraction=cache.memory_fraction, total_memory_bytes=device_memory_bytes(self.device),
                             weights_bytes=weights, reserve_bytes=ACTIVATION_RESERVE_BYTES, **common)


def make_executor(config: EngineConfig) -> Executor:
    """The executor for this config (worker processes when tensor_parallel_size > 1, later)."""
    return InProcessExecutor(config)
