"""Paged attention in plain torch: the correctness reference and the CPU fast path.

Every step first writes the new tokens' K/V into their slots, then attends over the cache, so a
fresh prompt, a later chunk of a prompt and a prefix-cache hit all read keys the same way.

What depends only on the batch -- which rows decode, the flat block ids to gather, the padding
mask -- is worked out once per step (`_plan`, cached on the `AttentionMetadata` that every layer
shares); a layer then does two `index_select`s and one `scaled_dot_product_attention` per group:

- decode rows (query_len 1) are batched: the decoding sequences' blocks are gathered into one
  padded (n, max_context, kv_heads, head_dim) tensor (a workspace reused by all layers), and
  the query heads that share a KV head become the "query rows" of that KV head:

      q (n, kv_heads, group, head_dim)  x  K (n, kv_heads, ctx, head_dim)  -> (n, kv_heads, group, head_dim)

  so GQA needs no repeated K/V, and an additive mask hides each sequence's padding. Sequences
  of very different lengths go in separate such batches (contexts within a factor of two), so
  a short one is never padded to a long one's length;
- longer queries (prompt chunks, speculative verification) go one sequence at a time through
  `scaled_dot_product_attention` (4-D, so torch's CPU flash kernel runs), causal when the chunk
  is the whole context, otherwise with a causal mask aligned to the end of the context.

`paged_attention_per_sequence` is the plain loop (one sequence, one head group at a time) kept as
the readable specification; the tests hold the batched path to it and to a dense computation.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from native_backend.model.attention import kv_quant
from native_backend.model.attention.metadata import AttentionMetadata
from native_backend.model.kv_cache import KVLayer

_PLAN_KEY = "reference_plan"


def write_kv(
    k: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
    v: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
    kv: KVLayer,  # blocks (num_blocks, block_size, num_kv_heads, head_dim)
    slot_mapping: torch.Tensor,  # (num_tokens,) int64
) -> None:
    """Each new token's K and V into its slot, quantized as the layer's dtype says (fp8: values
    beyond its range counted in `kv.clamped`)."""
    sides = ((k, kv.key, kv.k_scale, kv.key_scales), (v, kv.value, kv.v_scale, kv.value_scales))
    for side, (new, cache, layer_scale, row_scales) in enumerate(sides):
        if kv.clamped is not None:
            kv.clamped[side] += kv_quant.count_clamped(new, kv.dtype, layer_scale).to(kv.clamped.device)
        stored, scales = kv_quant.quantize(new, kv.dtype, layer_scale)
        flat = kv_quant.as_bytes(cache).view(-1, *cache.shape[2:])  # (num_slots, num_kv_heads, head_dim)
        flat.index_copy_(0, slot_mapping, kv_quant.as_bytes(stored))
        if scales is not None:
            row_scales.view(-1, row_scales.shape[2]).index_copy_(0, slot_mapping, scales)


def paged_attention(
    q: torch.Tensor,  # (num_tokens, num_heads, head_dim)
    kv: KVLayer,
    metadata: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # (num_tokens, num_heads, head_dim)
    plan = _plan(metadata, q)
    if len(plan.decode) == 1 and plan.decode[0].rows is None:  # every row decodes, one group
        return _decode(q, kv, plan.decode[0], scale)
    if not plan.decode and len(plan.prefills) == 1 and plan.prefills[0].rows == slice(0, q.shape[0]):
        return prefill(q, kv, plan.prefills[0], scale)
    out = torch.empty_like(q)
    for g in plan.decode:
        out.index_copy_(0, g.rows, _decode(q.index_select(0, g.rows), kv, g, scale))
    for p in plan.prefills:
        out[p.rows] = prefill(q[p.rows], kv, p, scale)
    return out


# ------------------------------------------------------------------------------ the per-step plan


@dataclass
class _DecodeGroup:
    """The decoding sequences of a step, gathered and attended as one padded batch."""

    rows: torch.Tensor | None  # their rows of q; None: all rows, one per sequence, in order
    block_ids: torch.Tensor  # (n * num_blocks,) int64: blocks to gather, sequence-major
    num_seqs: int
    num_blocks: int  # blocks per sequence after padding: cdiv(max_ctx, block_size)
    max_ctx: int
    mask: torch.Tensor | None  # (n, 1, 1, max_ctx) additive (0 / -inf); None: no padding at all
    # Gather workspaces, reused by every layer of the step: (n * num_blocks, block_size, kv, d).
    buffers: dict = field(default_factory=dict)


@dataclass
class _PrefillSeq:
    rows: slice  # its rows of q
    block_ids: torch.Tensor  # (cdiv(ctx, block_size),) int64
    ctx: int
    mask: torch.Tensor | None  # (q_len, ctx) additive, causal from the end; None: is_causal


@dataclass
class _Plan:
    decode: list[_DecodeGroup]  # decoding sequences, in groups of similar context length
    prefills: list[_PrefillSeq]


def _plan(md: AttentionMetadata, q: torch.Tensor) -> _Plan:
    """Built by the first layer of a step, reused by the others (the metadata is per step)."""
    plan = md.scratch.get(_PLAN_KEY)
    if plan is None:
        plan = md.scratch[_PLAN_KEY] = _build_plan(md, q.dtype, q.device)
    return plan


def _build_plan(md: AttentionMetadata, dtype: torch.dtype, device: torch.device) -> _Plan:
    q_lens, ctx_lens, bs = md.query_lens_cpu, md.context_lens_cpu, md.block_size
    decode_seqs = [s for s, n in enumerate(q_lens) if n == 1]
    all_decode = len(decode_seqs) == len(q_lens)
    starts = None if all_decode else _start_rows(q_lens)
    decode = []
    for seqs in _length_groups(decode_seqs, ctx_lens):
        ctxs = [ctx_lens[s] for s in seqs]
        max_ctx = max(ctxs)
        num_blocks = -(-max_ctx // bs)
        if all_decode and len(seqs) == len(q_lens):  # rows are the sequences, in order
            rows, tables, ctx_t = None, md.block_tables[:, :num_blocks], md.context_lens
        else:
            seq_idx = torch.tensor(seqs, device=device)
            rows = seq_idx if all_decode else torch.tensor([starts[s] for s in seqs], device=device)
            tables, ctx_t = md.block_tables[seq_idx, :num_blocks], md.context_lens[seq_idx]
        mask = None
        if min(ctxs) != max_ctx:
            pad = torch.arange(max_ctx, device=device)[None, :] >= ctx_t[:, None]  # (n, max_ctx)
            mask = torch.zeros(pad.shape, dtype=dtype, device=device).masked_fill_(pad, float("-inf"))
            mask = mask[:, None, None, :]
        decode.append(_DecodeGroup(rows, tables.reshape(-1).long(), len(seqs), num_blocks, max_ctx, mask))
    prefills = []
    start = 0
    for s, (q_len, ctx) in enumerate(zip(q_lens, ctx_lens)):
        if q_len != 1:
            prefills.append(prefill_seq(md, s, start, dtype, device))
        start += q_len
    return _Plan(decode, prefills)


def prefill_seq(md: AttentionMetadata, s: int, start: int, dtype: torch.dtype, device) -> _PrefillSeq:
    """What `prefill` needs for sequence `s`, whose rows of q begin at `start`."""
    q_len, ctx = md.query_lens_cpu[s], md.context_lens_cpu[s]
    mask = None
    if q_len != ctx:  # bottom-right causal: query i sits at position ctx - q_len + i
        q_pos = torch.arange(ctx - q_len, ctx, device=device)[:, None]
        hidden = torch.arange(ctx, device=device)[None, :] > q_pos
        mask = torch.zeros(hidden.shape, dtype=dtype, device=device).masked_fill_(hidden, float("-inf"))
    ids = md.block_tables[s, : -(-ctx // md.block_size)].long()
    return _PrefillSeq(slice(start, start + q_len), ids, ctx, mask)


# Decodes are grouped by context length so that short ones are not padded to the longest: a
# group takes the contexts in (longest / 2, longest], but at least this many sequences, and a
# tail shorter than this joins the group before it (each group costs a few more ops per layer).
_MIN_GROUP = 4


def _length_groups(seqs: list[int], ctx_lens: list[int]) -> list[list[int]]:
    """Partition `seqs` into groups of similar context length, each in ascending seq order."""
    if not seqs:
        return []
    order = sorted(seqs, key=lambda s: -ctx_lens[s])
    groups, i = [], 0
    while i < len(order):
        longest, j = ctx_lens[order[i]], i
        while j < len(order) and (2 * ctx_lens[order[j]] > longest or j - i < _MIN_GROUP):
            j += 1
        if len(order) - j < _MIN_GROUP:
            j = len(order)
        groups.append(sorted(order[i:j]))
        i = j
    return groups


def _start_rows(q_lens: list[int]) -> list[int]:
    starts, row = [], 0
    for n in q_lens:
        starts.append(row)
        row += n
    return starts


# ------------------------------------------------------------------------------ the two paths


def _decode(q, kv: KVLayer, g: _DecodeGroup, scale: float) -> torch.Tensor:
    """q: (n, num_heads, head_dim), one row per decoding sequence -> (n, num_heads, head_dim)."""
    n, num_heads, head_dim = q.shape
    kv_heads, padded = kv.num_kv_heads, g.num_blocks * kv.block_size
    k = read_blocks(kv, "k", g.block_ids, q.dtype, g).view(n, padded, kv_heads, head_dim)[:, : g.max_ctx]
    v = read_blocks(kv, "v", g.block_ids, q.dtype, g).view(n, padded, kv_heads, head_dim)[:, : g.max_ctx]
    qg = q.reshape(n, kv_heads, num_heads // kv_heads, head_dim)  # the group's heads as query rows
    o = F.scaled_dot_product_attention(qg, k.transpose(1, 2), v.transpose(1, 2), attn_mask=g.mask, scale=scale)
    return o.reshape(n, num_heads, head_dim)


def read_blocks(kv: KVLayer, side: str, block_ids: torch.Tensor, dtype: torch.dtype,
                group: _DecodeGroup | None = None) -> torch.Tensor:
    """Blocks `block_ids` of the layer's K ("k") or V ("v"), dequantized to `dtype`:
    (len(block_ids), block_size, kv_heads, head_dim). A decode group's gather reuses its buffers."""
    cache = kv.key if side == "k" else kv.value
    raw = kv_quant.as_bytes(cache)
    raw = _gather_into(group, side, raw) if group is not None else raw.index_select(0, block_ids)
    if not kv.dtype.quantized:
        return raw if raw.dtype == dtype else raw.to(dtype)
    row_scales = kv.key_scales if side == "k" else kv.value_scales
    scales = row_scales.index_select(0, block_ids) if row_scales is not None else None
    return kv_quant.dequantize(raw, scales, kv.dtype, kv.k_scale if side == "k" else kv.v_scale, dtype)


def _gather_into(g: _DecodeGroup, name: str, cache: torch.Tensor) -> torch.Tensor:
    buf = g.buffers.get(name)
    if buf is None or buf.dtype != cache.dtype or buf.shape[1:] != cache.shape[1:]:
        buf = g.buffers[name] = cache.new_empty((g.block_ids.numel(), *cache.shape[1:]))
    return torch.index_select(cache, 0, g.block_ids, out=buf)


def prefill(q, kv: KVLayer, p: _PrefillSeq, scale: float) -> torch.Tensor:
    """q: (q_len, num_heads, head_dim) of one sequence -> (q_len, num_heads, head_dim)."""
    k = read_blocks(kv, "k", p.block_ids, q.dtype).flatten(0, 1)[: p.ctx]  # (ctx, kv_heads, head_dim)
    v = read_blocks(kv, "v", p.block_ids, q.dtype).flatten(0, 1)[: p.ctx]
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],  # (1, num_heads, q_len, head_dim)
        k.transpose(0, 1)[None],  # (1, kv_heads, ctx, head_dim)
        v.transpose(0, 1)[None],
        attn_mask=p.mask,
        is_causal=p.mask is None,
        scale=scale,
        enable_gqa=True,
    )  # (1, num_heads, q_len, head_dim)
    return o[0].transpose(0, 1)


# ------------------------------------------------------------------------------ the specification


def paged_attention_per_sequence(q: torch.Tensor, kv: KVLayer, metadata: AttentionMetadata, scale: float) -> torch.Tensor:
    """Same contract as `paged_attention`, one sequence at a time, no batching or shared plan:
    softmax(q k^T * scale, causal by absolute position) v with the query heads of a group
    sharing their KV head. Slow; for tests and for reading."""
    out = torch.empty_like(q)
    bs = metadata.block_size
    num_kv_heads = kv.num_kv_heads
    group = q.shape[1] // num_kv_heads
    start = 0
    for s, (q_len, ctx) in enumerate(zip(metadata.query_lens_cpu, metadata.context_lens_cpu)):
        positions = torch.arange(ctx)
        slots = metadata.block_tables[s, positions // bs].long() * bs + positions % bs
        all_blocks = torch.arange(kv.num_blocks)
        k = read_blocks(kv, "k", all_blocks, q.dtype).flatten(0, 1)[slots]  # (ctx, kv_heads, head_dim)
        v = read_blocks(kv, "v", all_blocks, q.dtype).flatten(0, 1)[slots]
        q_pos = torch.arange(ctx - q_len, ctx)[:, None]
        hidden = positions[None, :] > q_pos  # (q_len, ctx)
        for h in range(q.shape[1]):
            scores = (q[start : start + q_len, h] @ k[:, h // group].T) * scale  # (q_len, ctx)
            probs = scores.masked_fill(hidden, float("-inf")).softmax(-1)
            out[start : start + q_len, h] = probs @ v[:, h // group]
        start += q_len
    return out
