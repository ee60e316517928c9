"""Paged attention on x86-64 CPUs: short queries through the C kernel, long ones through torch.

Rows of a sequence with few new tokens this step (decode: one; a short chunk, or the k+1 rows of
a speculative verification: up to `SHORT_QUERY_MAX`) are attended by `cpu_kernels.paged_decode`,
which reads every key and value once, straight from its block: no gathered copy of the cache,
no padding, one call per layer for the whole batch. Row i of a sequence whose last q_len
positions are new sees its first ctx - q_len + i + 1 positions (causal):

    sequence s, ctx 7, q_len 2:   positions 0 1 2 3 4 5 6
                                  row 0 sees ^---------^       (6 keys)
                                  row 1 sees ^-----------^     (7 keys)

Longer chunks (prompts) go one sequence at a time through `cpu_kernels.prefill_attention`, a
FlashAttention-style causal kernel over the sequence's blocks (head sizes that are multiples of
32; others through the reference's SDPA `prefill`). The per-step plan is built by the first layer
and kept on the metadata for the others.

Float32 queries with head_dim a multiple of 8, over a float32 cache or a quantized one (fp8 with
per-layer scales, int8 with per-row scales: written by `cpu_kernels.write_kv_q`, decoded inside
the decode kernel's loops; a prompt chunk's blocks are dequantized once, then the float32 prefill
kernel runs). Anything else (a bf16 cache, no kernels) runs the reference implementation.

`prefill_bf16=True` (the engine's `prefill_attention` setting, layers/prefill_attention.py;
bound by `get_attention_backend(..., prefill_bf16=True)`) sends the prompt chunks of a step of at
least BF16_MIN_ROWS rows to the prefill kernel's bf16 variant (bf16 products, float32 sums and
softmax); decode rows, short chunks and smaller steps keep their float32 kernels, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from native_backend.kernels import cpu_kernels
from native_backend.model.attention import kv_quant, reference
from native_backend.model.attention.metadata import AttentionMetadata
from native_backend.model.kv_cache import KVLayer

SHORT_QUERY_MAX = 8  # new tokens of a sequence up to which its rows go through the kernel
# prefill_bf16: the prompt chunks of a step of this many rows or more run the bf16 kernel, the steps
# whose products run in bf16 (prefill_matmul.BF16_MIN_ROWS); a smaller step keeps float32 throughout
BF16_MIN_ROWS = 64
_PLAN_KEY = "cpu_plan"


def write_kv(k, v, kv: KVLayer, slot_mapping) -> None:
    """The reference's write_kv; float32 and quantized caches through one C call for both."""
    if k.dtype != torch.float32 or not cpu_kernels.available():
        reference.write_kv(k, v, kv, slot_mapping)
    elif kv.dtype.quantized:
        cpu_kernels.write_kv_q(k, v, quantized_view(kv), slot_mapping)
    elif kv.key.dtype == torch.float32:
        cpu_kernels.write_kv(k, v, kv.key, kv.value, slot_mapping)
    else:
        reference.write_kv(k, v, kv, slot_mapping)


def quantized_view(kv: KVLayer) -> cpu_kernels.QuantizedKV:
    """What the quantized C kernels read of a layer (models.fused_decode builds its table from it)."""
    lut = kv_quant.fp8_lut(kv.dtype.storage) if kv.dtype.scaling == "per_layer" else None
    return cpu_kernels.QuantizedKV(kv_quant.as_bytes(kv.key), kv_quant.as_bytes(kv.value), kv.dtype.code,
                                   kv.k_scale, kv.v_scale, kv.key_scales, kv.value_scales, lut, kv.clamped)


@dataclass
class _Plan:
    short_rows: torch.Tensor | None  # (n,) int64 rows of q for the kernel; None: every row
    row_seq: torch.Tensor  # (n,) int64: the sequence of each of those rows
    row_keys: torch.Tensor  # (n,) int64: how many leading positions each row attends to
    chunk_blocks: int  # blocks per work item of the kernel, the same for every layer
    prefills: list  # reference._PrefillSeq for the longer chunks


def supports(q: torch.Tensor, kv: KVLayer) -> bool:
    cache_k = kv.key
    return (q.dtype == torch.float32 and (cache_k.dtype == torch.float32 or kv.dtype.quantized)
            and q.shape[-1] % 8 == 0 and cache_k.is_contiguous() and cpu_kernels.available())


def paged_attention(
    q: torch.Tensor,  # (num_tokens, num_heads, head_dim)
    kv: KVLayer,
    metadata: AttentionMetadata,
    scale: float,
    *,
    prefill_bf16: bool = False,  # prompt chunks through the bf16 prefill kernel (cpu_kernels.bf16_prefill_problem)
) -> torch.Tensor:  # (num_tokens, num_heads, head_dim)
    if not supports(q, kv):
        return reference.paged_attention(q, kv, metadata, scale)
    plan = step_plan(metadata, q.dtype, q.device)
    if plan.short_rows is None and not plan.prefills:  # the common decode step: every row
        return _short_rows(q, kv, metadata, plan, scale)
    out = torch.empty_like(q)
    if plan.row_seq.numel():
        short_q = q.index_select(0, plan.short_rows)
        out.index_copy_(0, plan.short_rows, _short_rows(short_q, kv, metadata, plan, scale))
    for p in plan.prefills:
        out[p.rows] = _prefill(q[p.rows], kv, p, scale, prefill_bf16 and q.shape[0] >= BF16_MIN_ROWS)
    return out


def _prefill(q, kv: KVLayer, p, scale: float, bf16: bool = False) -> torch.Tensor:
    """One sequence's prompt chunk: the C kernel where its register tiles fit the head size."""
    if q.shape[-1] not in cpu_kernels.PREFILL_HEAD_DIMS:
        return reference.prefill(q, kv, p, scale)
    if not kv.dtype.quantized:
        return cpu_kernels.prefill_attention(q, kv.key, kv.value, p.block_ids, p.ctx, scale, bf16=bf16)
    # The chunk's blocks, dequantized once (the kernel reads every key many times), in order.
    k = reference.read_blocks(kv, "k", p.block_ids, torch.float32)
    v = reference.read_blocks(kv, "v", p.block_ids, torch.float32)
    in_order = torch.arange(k.shape[0], dtype=torch.long)
    return cpu_kernels.prefill_attention(q, k, v, in_order, p.ctx, scale, bf16=bf16)


def step_plan(md: AttentionMetadata, dtype: torch.dtype, device: torch.device) -> _Plan:
    """The step's plan, built by the first layer that asks and kept on the metadata."""
    plan = md.scratch.get(_PLAN_KEY)
    if plan is None:
        plan = md.scratch[_PLAN_KEY] = _build_plan(md, dtype, device)
    return plan


def _short_rows(q, kv: KVLayer, md: AttentionMetadata, plan: _Plan, scale: float) -> torch.Tensor:
    if kv.dtype.quantized:
        return cpu_kernels.paged_decode_q(q, quantized_view(kv), md.block_tables, plan.row_seq, plan.row_keys, scale,
                                          chunk_blocks=plan.chunk_blocks)
    return cpu_kernels.paged_decode(q, kv.key, kv.value, md.block_tables, plan.row_seq, plan.row_keys, scale,
                                    chunk_blocks=plan.chunk_blocks)


def _build_plan(md: AttentionMetadata, dtype: torch.dtype, device: torch.device) -> _Plan:
    rows, row_seq, row_keys, prefills = [], [], [], []
    start = 0
    for s, (q_len, ctx) in enumerate(zip(md.query_lens_cpu, md.context_lens_cpu)):
        if q_len <= SHORT_QUERY_MAX:
            rows.extend(range(start, start + q_len))
            row_seq.extend([s] * q_len)
            row_keys.extend(range(ctx - q_len + 1, ctx + 1))
        else:
            prefills.append(reference.prefill_seq(md, s, start, dtype, device))
        start += q_len
    every_row = len(rows) == start
    as_tensor = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)  # noqa: E731
    keys = as_tensor(row_keys)
    chunk_blocks = cpu_kernels.default_chunk_blocks(keys, md.block_size) if row_keys else 1
    return _Plan(None if every_row else as_tensor(rows), as_tensor(row_seq), keys, chunk_blocks, prefills)
