"""Paged attention as Triton kernels: the CUDA path, same signatures as `reference`.

- `_write_kv_kernel`: one program per token copies its K and V rows into their slots.
- `_decode_kernel`: one program per (sequence, KV head) walks the sequence's blocks straight from
  the block table, scoring the group of query heads that share that KV head, online softmax.
- `_prefill_kernel`: FlashAttention-style. One program per (sequence, query head, tile of
  BLOCK_M query rows); it walks K/V one cache block at a time up to the last key its tile may see,
  keeping a running max / sum / accumulator per row, so the score matrix is never materialised.
  Cached blocks (earlier chunks, shared prefixes) are read exactly like this step's keys.

All tested on CPU under TRITON_INTERPRET=1 against the torch reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from native_backend.attention.metadata import AttentionMetadata
from native_backend.kv_cache import KVLayer

_MIN_DOT = 16  # tl.dot wants every dimension >= 16


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, cache_k_ptr, cache_v_ptr, slot_ptr,
    stride_k_tok, stride_v_tok,
    ROW: tl.constexpr,  # num_kv_heads * head_dim: one slot's worth of elements
    BLOCK: tl.constexpr,  # ROW rounded up to a power of two
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    # A negative slot marks a padding token: skip it (compared as a vector so the mask is one).
    mask = (offs < ROW) & ((offs * 0 + slot) >= 0)
    k = tl.load(k_ptr + token * stride_k_tok + offs, mask=mask)
    v = tl.load(v_ptr + token * stride_v_tok + offs, mask=mask)
    tl.store(cache_k_ptr + slot * ROW + offs, k.to(cache_k_ptr.dtype.element_ty), mask=mask)
    tl.store(cache_v_ptr + slot * ROW + offs, v.to(cache_v_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _decode_kernel(
    out_ptr, q_ptr, cache_k_ptr, cache_v_ptr, block_tables_ptr, context_lens_ptr, query_start_ptr,
    scale,
    stride_q_tok, stride_q_head, stride_o_tok, stride_o_head, stride_table,
    stride_c_block, stride_c_slot, stride_c_head,
    GROUP: tl.constexpr, GROUP_P2: tl.constexpr,  # query heads per KV head, and its power of two
    PAGE: tl.constexpr, PAGE_P2: tl.constexpr,  # block_size, and its power of two
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    token = tl.load(query_start_ptr + seq).to(tl.int64)  # decode: one query row per sequence
    ctx = tl.load(context_lens_ptr + seq)

    g = tl.arange(0, GROUP_P2)
    d = tl.arange(0, BLOCK_D)
    s = tl.arange(0, PAGE_P2)
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    heads = kv_head * GROUP + g
    q = tl.load(
        q_ptr + token * stride_q_tok + heads[:, None] * stride_q_head + d[None, :],
        mask=g_mask[:, None] & d_mask[None, :], other=0.0,
    ).to(tl.float32)  # (GROUP_P2, BLOCK_D)

    m_i = tl.zeros([GROUP_P2], dtype=tl.float32) - float("inf")  # running max
    l_i = tl.zeros([GROUP_P2], dtype=tl.float32)  # running sum of exp
    acc = tl.zeros([GROUP_P2, BLOCK_D], dtype=tl.float32)
    for page in range(0, tl.cdiv(ctx, PAGE)):
        block = tl.load(block_tables_ptr + seq * stride_table + page).to(tl.int64)
        key_pos = page * PAGE + s
        s_mask = (s < PAGE) & (key_pos < ctx)
        kv_offs = block * stride_c_block + s[:, None] * stride_c_slot + kv_head * stride_c_head + d[None, :]
        kv_mask = s_mask[:, None] & d_mask[None, :]
        k = tl.load(cache_k_ptr + kv_offs, mask=kv_mask, other=0.0).to(tl.float32)  # (PAGE_P2, BLOCK_D)
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # (GROUP_P2, PAGE_P2)
        scores = tl.where(s_mask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        v = tl.load(cache_v_ptr + kv_offs, mask=kv_mask, other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new

    out = acc / l_i[:, None]
    tl.store(
        out_ptr + token * stride_o_tok + heads[:, None] * stride_o_head + d[None, :],
        out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :],
    )


@triton.jit
def _prefill_kernel(
    out_ptr, q_ptr, cache_k_ptr, cache_v_ptr, block_tables_ptr, context_lens_ptr, query_start_ptr,
    scale,
    stride_q_tok, stride_q_head, stride_o_tok, stride_o_head, stride_table,
    stride_c_block, stride_c_slot, stride_c_head,
    GROUP: tl.constexpr,
    PAGE: tl.constexpr, PAGE_P2: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" keeps fp32 models exact; tf32 would cost ~1e-3
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    tile = tl.program_id(2)
    q_start = tl.load(query_start_ptr + seq).to(tl.int64)
    q_len = (tl.load(query_start_ptr + seq + 1) - tl.load(query_start_ptr + seq)).to(tl.int32)
    if tile * BLOCK_M >= q_len:
        return
    ctx = tl.load(context_lens_ptr + seq)
    kv_head = head // GROUP

    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    r_mask = rows < q_len
    q_pos = ctx - q_len + rows  # absolute positions of this tile's queries
    d = tl.arange(0, BLOCK_D)
    s = tl.arange(0, PAGE_P2)
    d_mask = d < HEAD_DIM
    q = tl.load(
        q_ptr + (q_start + rows[:, None]) * stride_q_tok + head * stride_q_head + d[None, :],
        mask=r_mask[:, None] & d_mask[None, :], other=0.0,
    )  # (BLOCK_M, BLOCK_D)

    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # Causality: no key beyond the tile's last query position is needed.
    kv_end = tl.minimum(ctx - q_len + (tile + 1) * BLOCK_M, ctx)
    for page in range(0, tl.cdiv(kv_end, PAGE)):
        block = tl.load(block_tables_ptr + seq * stride_table + page).to(tl.int64)
        key_pos = page * PAGE + s
        s_mask = (s < PAGE) & (key_pos < kv_end)
        kv_offs = block * stride_c_block + s[:, None] * stride_c_slot + kv_head * stride_c_head + d[None, :]
        kv_mask = s_mask[:, None] & d_mask[None, :]
        k = tl.load(cache_k_ptr + kv_offs, mask=kv_mask, other=0.0).to(q.dtype)  # (PAGE_P2, BLOCK_D)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale  # (BLOCK_M, PAGE_P2)
        visible = s_mask[None, :] & (key_pos[None, :] <= q_pos[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        # Every real row sees key 0, so m_new is finite after the first page.
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        v = tl.load(cache_v_ptr + kv_offs, mask=kv_mask, other=0.0).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new

    out = acc / l_i[:, None]
    tl.store(
        out_ptr + (q_start + rows[:, None]) * stride_o_tok + head * stride_o_head + d[None, :],
        out.to(out_ptr.dtype.element_ty), mask=r_mask[:, None] & d_mask[None, :],
    )


def write_kv(
    k: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
    v: torch.Tensor,
    kv: KVLayer,  # blocks (num_blocks, block_size, num_kv_heads, head_dim), contiguous
    slot_mapping: torch.Tensor,  # (num_tokens,) int64; -1 skips a token
) -> None:
    cache_k, cache_v = kv.key, kv.value
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    k = k.reshape(num_tokens, -1)  # rows must be contiguous (a copy only if they were not)
    v = v.reshape(num_tokens, -1)
    row = k.shape[1]
    _write_kv_kernel[(num_tokens,)](
        k, v, cache_k, cache_v, slot_mapping,
        k.stride(0), v.stride(0),
        ROW=row, BLOCK=triton.next_power_of_2(row),
    )


def paged_attention(
    q: torch.Tensor,  # (num_tokens, num_heads, head_dim)
    kv: KVLayer,
    metadata: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # (num_tokens, num_heads, head_dim)
    cache_k, cache_v = kv.key, kv.value
    q = q if q.stride(-1) == 1 else q.contiguous()
    out = torch.empty_like(q)
    num_heads, head_dim = q.shape[1], q.shape[2]
    _, block_size, num_kv_heads, _ = cache_k.shape
    group = num_heads // num_kv_heads
    common = (
        out, q, cache_k, cache_v, metadata.block_tables, metadata.context_lens, metadata.query_start_loc,
        scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), metadata.block_tables.stride(0),
        cache_k.stride(0), cache_k.stride(1), cache_k.stride(2),
    )
    page_p2 = max(_MIN_DOT, triton.next_power_of_2(block_size))
    block_d = max(_MIN_DOT, triton.next_power_of_2(head_dim))
    if metadata.is_decode_only:
        _decode_kernel[(metadata.num_seqs, num_kv_heads)](
            *common,
            GROUP=group, GROUP_P2=triton.next_power_of_2(group),
            PAGE=block_size, PAGE_P2=page_p2, HEAD_DIM=head_dim, BLOCK_D=block_d,
        )
    else:
        block_m = _MIN_DOT if metadata.max_query_len <= _MIN_DOT else 64
        grid = (metadata.num_seqs, num_heads, triton.cdiv(metadata.max_query_len, block_m))
        _prefill_kernel[grid](
            *common,
            GROUP=group, PAGE=block_size, PAGE_P2=page_p2, HEAD_DIM=head_dim, BLOCK_D=block_d,
            BLOCK_M=block_m, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        )
    return out
