"""The executor: everything between the engine core and the model on its device(s).

    engine core ── SchedulerOutput ──> Executor.execute() ──> RunnerOutput
                                          │ builds the model in its final form (LayerContext),
                                          │ sizes and allocates the KV cache, runs the ModelRunner
                                          │ speculative decoding: the proposer fills the step's
                                          │ draft slots first (spec_decode.proposer)
                                          └─ tensor parallelism: rank 0 here, ranks 1..N-1 in worker
                                             processes that receive each step's SchedulerOutput

The engine core never touches the model: what it needs to know (the model's shape, the context
length, the cache plan) comes from the executor as plain data.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Protocol

import torch

from native_backend.config.engine import CUDA_RESERVE_BYTES, EngineConfig
from native_backend.config.model import ModelConfig
from native_backend.core.batch import RunnerOutput, SchedulerOutput
from native_backend.execution import kv_scales
from native_backend.execution.model_runner import ModelRunner
from native_backend.execution.parallel.report import weight_bytes_by_kind
from native_backend.execution.spec_decode import draft_model
from native_backend.execution.spec_decode.factory import make_proposer
from native_backend.execution.spec_decode.proposer import Proposer, propose_drafts
from native_backend.model.kv_cache import KVCache, KVCachePlan, device_memory_bytes, plan_kv_cache, resolve_kv_dtype
from native_backend.model.layers.context import LayerContext
from native_backend.model.layers.sharding import SINGLE, ShardSpec
from native_backend.model.layers.stages import WHOLE, StageSpec
from native_backend.model.loader import load_model
from native_backend.model.quantization.method import describe_weights, weights_format
from native_backend.text.tokenizer import Tokenizer

log = logging.getLogger("kvgate.engine")

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Executor(Protocol):
    model_config: ModelConfig
    max_model_len: int
    plan: KVCachePlan
    weights: str  # the decoder linears' format (quantization.method.weights_format)
    kernel_path: str  # the CPU kernels' path that runs ("avx512", "avx2"); "" where none does
    prefill_path: str  # CPU float32: prompt chunks' matmuls and attention, e.g. "matmuls bf16, attention bf16"

    # Steps the engine core may keep in flight: 1 runs each step to its end with execute(); P > 1
    # (pipeline parallelism) lets it submit() up to P and collect() their outputs oldest first.
    max_concurrent_batches: int

    def execute(self, scheduled: SchedulerOutput) -> RunnerOutput: ...

    def submit(self, scheduled: SchedulerOutput) -> None:
        """Start a step without waiting for its output (only where max_concurrent_batches > 1)."""

    def collect(self) -> RunnerOutput:
        """The oldest submitted step's output (only where max_concurrent_batches > 1)."""

    def count_drafts(self, request_id: str, tokens: list[int], k: int) -> int:
        """How many of k draft slots the proposer fills for this request now (the scheduler's
        speculation policy reserves only those)."""

    def describe(self) -> str: ...

    def kv_clamped(self) -> tuple[int, int]: ...

    def check_health(self) -> None: ...

    def close(self) -> None: ...


class InProcessExecutor:
    """One rank's model and KV cache in this process: the whole model on one device (shard 0 of
    1), or one tensor-parallel rank's shard of one pipeline stage's layers (rank 0 under
    parallel.TensorParallelExecutor, or a worker), which then allocates its cache in a second
    phase (`allocate=False`, `link` set for a pipeline stage, then `allocate_cache`) once every
    rank has agreed on the number of blocks."""

    max_concurrent_batches = 1  # execute() runs a step to its end

    def __init__(self, config: EngineConfig, shard: ShardSpec = SINGLE, device: torch.device | None = None,
                 *, allocate: bool = True, tokenizer: Tokenizer | None = None, stage: StageSpec = WHOLE):
        mc = config.model
        self._tokenizer = tokenizer  # the process's (process.factory); None: loaded when first needed
        if mc.num_threads:
            torch.set_num_threads(mc.num_threads)
        self.config = config
        self.shard = shard
        self.device = torch.device(device or mc.device)
        self.ctx = LayerContext.for_device(self.device, TORCH_DTYPES[mc.dtype], cpu_kernels=mc.cpu_kernels,
                                           shard=shard, stage=stage)
        self.ctx = dataclasses.replace(self.ctx, gguf_q4=mc.quantization == "gguf",  # GGUF Q4 linears kept int4
                                       int8_head=mc.lm_head != "float", prefill_attention=mc.prefill_attention,
                                       decode_matmul=mc.decode_matmul).with_prefill_matmul(mc.prefill_matmul)
        self.model = load_model(mc.path, self.ctx)
        self.weights = weights_format(self.model)  # "float32", "int4 AWQ g64", ...: for the engine's stats
        self.kernel_path = self.ctx.kernel_path
        self.prefill_path = self.model.ctx.prefill_path  # as the checkpoint's format resolved it
        self.draft_model = draft_model.load_separate_draft(config, self.model, self.ctx,
                                                           self.tokenizer)  # None: no own-KV draft
        self.model_config: ModelConfig = self.model.config
        self.num_kv_heads = self.model.attention_layers()[0].num_kv_heads  # this rank's
        self.num_layers = len(self.model.attention_layers())  # this pipeline stage's
        self.link = None  # a pipeline stage's StageLink (parallel.stage_link), set before allocate_cache
        limit = config.scheduler.max_model_len or self.model_config.max_position_embeddings
        self.max_model_len = min(limit, self.model_config.max_position_embeddings)
        self.kv_dtype = resolve_kv_dtype(config.kv_cache_dtype)
        self.plan = draft_model.leave_room_for_draft(self._plan_kv_cache(), draft_model.draft_kv_bytes_per_token(
            self.draft_model, TORCH_DTYPES[mc.dtype]))
        self.kv_cache: KVCache | None = None
        self.runner: ModelRunner | None = None
        self.proposer: Proposer | None = None  # speculative decoding's (None: off)
        self.lora = None  # lora.LoRAManager with enable_lora: the adapters beside the model's linears
        if allocate:
            self.allocate_cache(self.plan.num_blocks)

    def allocate_cache(self, num_blocks: int, calibration_ids: list[int] | None = None) -> None:
        """The KV cache of `num_blocks` (at most the plan's), its fp8 scales, and the runner."""
        if num_blocks != self.plan.num_blocks:
            self.plan = shrink_plan(self.plan, num_blocks)
        fp8 = self._fp8_scales(calibration_ids) if self.kv_dtype.scaling == "per_layer" else None
        self.kv_cache = KVCache(num_layers=self.num_layers, num_blocks=self.plan.num_blocks,
                                block_size=self.config.cache.block_size, num_kv_heads=self.num_kv_heads,
                                head_dim=self.model_config.head_dim, dtype=self.kv_dtype, device=self.device)
        if fp8 is not None:
            kv_scales.apply(self.kv_cache, fp8.scales, fp8.k_offsets)
        self.proposer = make_proposer(self.config, self.model, self.kv_cache, self.draft_model, self.device,
                                      self.config.model.dtype)
        if self.config.lora.enable_lora and self.lora is None:
            from native_backend.model.lora import LoRAManager

            self.lora = LoRAManager.build(self.model, self.config.lora)
        self.runner = ModelRunner(self.model, self.kv_cache, self.device, link=self.link, lora=self.lora)

    @property
    def needs_calibration(self) -> bool:
        """fp8 KV whose scales come from a calibration pass (not the checkpoint's, not 1.0)."""
        mode = self.config.cache.kv_scales
        return self.kv_dtype.scaling == "per_layer" and (
            mode == "calibrate" or (mode == "auto" and self.model.kv_scales_from_checkpoint() is None))

    def tokenizer(self) -> Tokenizer:
        """The target model's tokenizer: the one the process passed in, else loaded once, here."""
        if self._tokenizer is None:
            mc = self.config.model
            self._tokenizer = Tokenizer.from_pretrained(mc.path, cache_dir=mc.tokenizer_cache_dir)
        return self._tokenizer

    def calibration_ids(self) -> list[int]:
        return kv_scales.calibration_ids(self.tokenizer(), min(kv_scales.CALIBRATION_TOKENS, self.max_model_len))

    def kv_clamped(self) -> tuple[int, int]:
        """(K, V) values an fp8 cache clamped at its range since start (kv_scales.clamped_totals)."""
        return kv_scales.clamped_totals(self.kv_cache) if self.kv_cache is not None else (0, 0)

    def check_health(self) -> None:
        """Raises when the executor can no longer run a step (tensor-parallel workers); here never."""

    def close(self) -> None:
        """Nothing to stop in-process."""

    def memory_report(self) -> dict:
        """This rank's resident bytes: weights by kind (split, replicated) and the KV cache; and what
        its prefill matmuls run in (every rank of a group alike)."""
        kinds = weight_bytes_by_kind(self.model, self.shard.size)
        return dict(rank=self.shard.rank, stage=self.ctx.stage.index, num_layers=self.num_layers,
                    weights_bytes=sum(kinds.values()), weights_by_kind=kinds,
                    kv_cache_bytes=self.kv_cache.nbytes if self.kv_cache is not None else 0,
                    kv_bytes_per_token=self.plan.bytes_per_token, num_blocks=self.plan.num_blocks,
                    num_kv_heads=self.num_kv_heads, prefill=self.model.ctx.prefill_note)

    def compute_logits(self, scheduled: SchedulerOutput, all_tokens: bool = False) -> dict[str, torch.Tensor]:
        """ModelRunner.compute_logits (tests and tools): one step's logits, no sampling."""
        return self.runner.compute_logits(scheduled, all_tokens)

    def execute(self, scheduled: SchedulerOutput) -> RunnerOutput:
        return self.runner.execute(*self.propose(scheduled))

    def propose(self, scheduled: SchedulerOutput) -> tuple[SchedulerOutput, dict[str, torch.Tensor]]:
        """The step with its draft slots filled (spec_decode.proposer.propose_drafts), and the
        draft model's q per request for the runner's verification."""
        return propose_drafts(self.proposer, scheduled)

    def count_drafts(self, request_id: str, tokens: list[int], k: int) -> int:
        """How many of k draft slots the proposer fills for this request now (the scheduler's
        speculation policy reserves only those)."""
        return self.proposer.count_drafts(request_id, tokens, k)

    def describe(self) -> str:
        p, mc = self.plan, self.config.model
        fp32_per_token = self.plan.bytes_per_token if self.kv_dtype.name == "float32" else (
            2 * self.model_config.num_layers * self.model_config.num_kv_heads * self.model_config.head_dim * 4)
        prefill = f"; {self.model.ctx.prefill_note}" if self.model.ctx.prefill_note else ""
        return (f"{mc.path} on {self.device} ({mc.dtype}, {self.model.ctx.kernels}{prefill}); "
                f"{describe_weights(self.model)}; "
                f"KV cache {self.kv_dtype.name} {p.kv_cache_bytes / 2**20:.0f} MiB = "
                f"{p.num_blocks} blocks x {p.block_size} tokens ({p.bytes_per_token} B/token, "
                f"{fp32_per_token / p.bytes_per_token:.2f}x the tokens of float32), "
                f"{p.full_context_sequences} sequences at full context {p.max_model_len}")

    def _fp8_scales(self, calibration_ids: list[int] | None = None) -> kv_scales.Calibration:
        """The checkpoint's per-layer scales, else a calibration pass's (with the keys' offsets);
        1.0 only when asked. Tensor-parallel ranks calibrate together on rank 0's
        `calibration_ids`, each over its own KV heads (its own offsets), and take each layer's
        largest scale, the one a single rank would find."""
        mode = self.config.cache.kv_scales
        if mode == "unit":
            log.warning("fp8 KV cache with unit scales (kv_scales: unit): values beyond %g are clipped",
                        self.kv_dtype.max_value)
            return kv_scales.Calibration([(1.0, 1.0)] * self.num_layers, None)
        scales = None if self.needs_calibration else self.model.kv_scales_from_checkpoint()
        if scales is not None:
            log.info("fp8 KV scales from the checkpoint: %s", kv_scales.describe(scales))
            return kv_scales.Calibration(scales, None)
        ids = calibration_ids if calibration_ids is not None else self.calibration_ids()
        found = kv_scales.calibrate(self.model, ids, self.kv_dtype, self.device, link=self.link)
        found = dataclasses.replace(found, scales=_max_over_ranks(found.scales, self.shard))
        log.info("fp8 KV scales from calibration over %d tokens: %s", len(ids), kv_scales.describe(found.scales))
        return found

    def _plan_kv_cache(self) -> KVCachePlan:
        mc, cache = self.model_config, self.config.cache
        kv_dtype = self.kv_dtype
        common = dict(num_layers=self.num_layers, num_kv_heads=self.num_kv_heads, head_dim=mc.head_dim,
                      bytes_per_element=kv_dtype.bytes_per_element,
                      scale_bytes_per_head=kv_dtype.scale_bytes_per_head, block_size=cache.block_size,
                      max_model_len=self.max_model_len)
        if cache.kv_cache_bytes is not None or self.device.type == "cpu":
            return plan_kv_cache(kv_cache_bytes=cache.kv_cache_bytes or cache.cpu_kv_cache_bytes, **common)
        weights = sum(t.numel() * t.element_size() for t in self.model.parameters())
        return plan_kv_cache(memory_fraction=cache.memory_fraction, total_memory_bytes=device_memory_bytes(self.device),
                             weights_bytes=weights, reserve_bytes=CUDA_RESERVE_BYTES, **common)


def shrink_plan(plan: KVCachePlan, num_blocks: int) -> KVCachePlan:
    """The same plan with fewer blocks (tensor-parallel ranks take the smallest rank's count)."""
    if num_blocks > plan.num_blocks:
        raise ValueError(f"{num_blocks} KV blocks asked of a plan that holds {plan.num_blocks}")
    return dataclasses.replace(plan, num_blocks=num_blocks, kv_cache_bytes=num_blocks * plan.bytes_per_block,
                               full_context_sequences=num_blocks // plan.blocks_per_full_sequence)


def _max_over_ranks(scales: list[tuple[float, float]], shard: ShardSpec) -> list[tuple[float, float]]:
    if shard.size == 1:
        return scales
    import torch.distributed as dist

    values = torch.tensor(scales, dtype=torch.float64)  # (layers, 2); gloo (a CPU tensor)
    dist.all_reduce(values, op=dist.ReduceOp.MAX, group=shard.group.pg if shard.group is not None else None)
    return [(float(k), float(v)) for k, v in values.tolist()]

