"""Paged attention as Triton kernels: the CUDA path, same signatures as `reference`.

- `_write_kv_kernel`: one program per token copies its K and V rows into their slots.
- `_decode_kernel`: one program per (sequence, KV head) walks the sequence's blocks straight from
  the block table, scoring the group of query heads that share that KV head, online softmax.
- `_prefill_kernel`: FlashAttention-style. One program per (sequence, query head, tile of
  BLOCK_M query rows); it walks K/V one cache block at a time up to the last key its tile may see,
  keeping a running max / sum / accumulator per row, so the score matrix is never materialised.
  Cached blocks (earlier chunks, shared prefixes) are read exactly like this step's keys.

Quantized caches (attention/kv_quant.py's rules): `_write_kv_quant_kernel` quantizes each token's
head of K and V (fp8 through its own round-to-nearest-even encoder, int8 with the head's scale), so
the stored bytes equal the reference's; the attention kernels read fp8 bytes through the 256-entry
table and int8 times its row scale (`_load_kv`), FMT a compile-time constant.

All tested on CPU under TRITON_INTERPRET=1 against the torch reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from native_backend.model.attention import kv_quant
from native_backend.model.attention.metadata import AttentionMetadata
from native_backend.model.kv_cache import KVLayer

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
def _encode_fp8(y, MAN: tl.constexpr, BIAS: tl.constexpr):
    """float32 (finite, within range) -> fp8 bits as int32, round to nearest even: csrc/kv_quant.c's
    encode_fp8, vectorised."""
    u = y.to(tl.int32, bitcast=True)
    sign = (u >> 24) & 0x80
    a = u & 0x7FFFFFFF
    e = (a >> 23) - 127 + BIAS
    m = (a & 0x7FFFFF) | 0x800000
    shift = 23 - MAN + tl.where(e <= 0, 1 - e, 0)
    e = tl.maximum(e, 0)
    s = tl.minimum(shift, 30)
    half = tl.full(s.shape, 1, tl.int32) << (s - 1)
    rem = m & ((tl.full(s.shape, 1, tl.int32) << s) - 1)
    q = m >> s
    q = q + ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(tl.int32)
    bits = tl.where(e > 0, (e << MAN) + q - (1 << MAN), q)
    bits = tl.where((a < 0x800000) | (shift > 25), 0, bits)
    return sign | bits


@triton.jit
def _write_kv_quant_kernel(
    k_ptr, v_ptr, cache_k_ptr, cache_v_ptr, k_scales_ptr, v_scales_ptr, slot_ptr, clamped_ptr,
    k_scale, v_scale, stride_k_tok, stride_v_tok,
    KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    FMT: tl.constexpr,  # 1 fp8 e4m3, 2 fp8 e5m2, 3 int8 (KVCacheDType.code)
):
    """One program per (token, KV head): its K and V rows of head_dim values. fp8 adds the
    values it clamps to clamped_ptr's (2, KV_HEADS) counters (KVLayer.clamped)."""
    token = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    mask = d < HEAD_DIM
    dst = (slot * KV_HEADS + head) * HEAD_DIM + d
    for side in tl.static_range(2):
        src_ptr = k_ptr if side == 0 else v_ptr
        stride = stride_k_tok if side == 0 else stride_v_tok
        cache_ptr = cache_k_ptr if side == 0 else cache_v_ptr
        x = tl.load(src_ptr + token * stride + head * HEAD_DIM + d, mask=mask, other=0.0).to(tl.float32)
        if FMT == 3:
            amax = tl.max(tl.abs(x), axis=0)
            row_scale = tl.math.div_rn(amax, 127.0)
            safe = tl.where(row_scale == 0.0, 1.0, row_scale)
            r = tl.math.div_rn(x, safe)
            r = (r + 12582912.0) - 12582912.0  # round to nearest even (|r| <= 127 << 2^22)
            r = tl.minimum(tl.maximum(r, -127.0), 127.0)
            tl.store(cache_ptr + dst, r.to(tl.int8), mask=mask)
            scales_ptr = k_scales_ptr if side == 0 else v_scales_ptr
            tl.store(scales_ptr + slot * KV_HEADS + head, row_scale)
        else:
            layer_scale = k_scale if side == 0 else v_scale
            MAX: tl.constexpr = 448.0 if FMT == 1 else 57344.0
            y = tl.math.div_rn(x, layer_scale)
            over = tl.sum((tl.abs(y) > MAX).to(tl.int64), axis=0)
            tl.atomic_add(clamped_ptr + side * KV_HEADS + head, over)
            y = tl.minimum(tl.maximum(y, -MAX), MAX)
            bits = _encode_fp8(y, 3 if FMT == 1 else 2, 7 if FMT == 1 else 15)
            tl.store(cache_ptr + dst, bits.to(tl.uint8), mask=mask)


@triton.jit
def _load_kv(cache_ptr, offs, mask, lut_ptr, layer_scale, scales_ptr, scale_offs, scale_mask, FMT: tl.constexpr):
    """K or V values at offs as float32: plain (FMT 0), fp8 through the table, int8 x row scale."""
    raw = tl.load(cache_ptr + offs, mask=mask, other=0)
    if FMT == 0:
        x = raw.to(tl.float32)
    elif FMT == 3:
        row_scale = tl.load(scales_ptr + scale_offs, mask=scale_mask, other=0.0)
        x = raw.to(tl.float32) * row_scale[:, None]
    else:
        x = tl.load(lut_ptr + raw.to(tl.int32), mask=mask, other=0.0) * layer_scale
    return x


@triton.jit
def _decode_kernel(
    out_ptr, q_ptr, cache_k_ptr, cache_v_ptr, block_tables_ptr, context_lens_ptr, query_start_ptr,
    scale,
    stride_q_tok, stride_q_head, stride_o_tok, stride_o_head, stride_table,
    stride_c_block, stride_c_slot, stride_c_head,
    lut_ptr, k_scales_ptr, v_scales_ptr, k_scale, v_scale, KV_HEADS,
    FMT: tl.constexpr,  # 0 plain float, 1/2 fp8 (table), 3 int8 (row scales)
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
        scale_offs = (block * PAGE + s) * KV_HEADS + kv_head  # int8's row scales, (PAGE_P2,)
        k = _load_kv(cache_k_ptr, kv_offs, kv_mask, lut_ptr, k_scale, k_scales_ptr, scale_offs, s_mask, FMT)
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # (GROUP_P2, PAGE_P2)
        scores = tl.where(s_mask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        v = _load_kv(cache_v_ptr, kv_offs, kv_mask, lut_ptr, v_scale, v_scales_ptr, scale_offs, s_mask, FMT)
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
    lut_ptr, k_scales_ptr, v_scales_ptr, k_scale, v_scale, KV_HEADS,
    FMT: tl.constexpr,
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
        scale_offs = (block * PAGE + s) * KV_HEADS + kv_head
        k = _load_kv(cache_k_ptr, kv_offs, kv_mask, lut_ptr, k_scale, k_scales_ptr, scale_offs, s_mask, FMT).to(q.dtype)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale  # (BLOCK_M, PAGE_P2)
        visible = s_mask[None, :] & (key_pos[None, :] <= q_pos[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        # Every real row sees key 0, so m_new is finite after the first page.
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        v = _load_kv(cache_v_ptr, kv_offs, kv_mask, lut_ptr, v_scale, v_scales_ptr, scale_offs, s_mask, FMT).to(q.dtype)
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
    if kv.dtype.quantized:
        dummy = _dummy(k.device)
        _write_kv_quant_kernel[(num_tokens, kv.num_kv_heads)](
            k, v, kv_quant.as_bytes(cache_k), kv_quant.as_bytes(cache_v),
            kv.key_scales if kv.key_scales is not None else dummy,
            kv.value_scales if kv.value_scales is not None else dummy, slot_mapping,
            kv.clamped if kv.clamped is not None else torch.zeros(2, kv.num_kv_heads, dtype=torch.int64, device=k.device),
            float(kv.k_scale), float(kv.v_scale), k.stride(0), v.stride(0),
            KV_HEADS=kv.num_kv_heads, HEAD_DIM=kv.head_dim, BLOCK_D=triton.next_power_of_2(kv.head_dim),
            FMT=kv.dtype.code,
        )
        return
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
        out, q, kv_quant.as_bytes(cache_k), kv_quant.as_bytes(cache_v), metadata.block_tables,
        metadata.context_lens, metadata.query_start_loc,
        scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), metadata.block_tables.stride(0),
        cache_k.stride(0), cache_k.stride(1), cache_k.stride(2),
        *_quant_args(kv, q.device),
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


def _dummy(device) -> torch.Tensor:
    """A pointer for a kernel argument the format does not read."""
    return torch.zeros(1, dtype=torch.float32, device=device)


def _quant_args(kv: KVLayer, device) -> tuple:
    """lut_ptr, k_scales_ptr, v_scales_ptr, k_scale, v_scale, KV_HEADS, FMT for the attention kernels."""
    dummy = _dummy(device)
    lut = kv_quant.fp8_lut(kv.dtype.storage, device) if kv.dtype.scaling == "per_layer" else dummy
    k_scales = kv.key_scales if kv.key_scales is not None else dummy
    v_scales = kv.value_scales if kv.value_scales is not None else dummy
    return lut, k_scales, v_scales, float(kv.k_scale), float(kv.v_scale), kv.num_kv_heads, kv.dtype.code
