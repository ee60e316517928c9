"""Paged attention in plain torch: the correctness reference and the CPU fast path.

Every step first writes the new tokens' K/V into their slots, then attends over the cache, so a
fresh prompt, a later chunk of a prompt and a prefix-cache hit all read keys the same way.
Two paths, chosen per sequence by its query length:

- decode rows (query_len 1) are batched: gather every decoding sequence's blocks into one padded
  (num_decodes, max_context, kv_heads, head_dim) tensor and do two batched matmuls, grouping the
  query heads that share a KV head instead of repeating K/V;
- longer queries (prompt chunks, speculative verification) go one sequence at a time through
  `scaled_dot_product_attention` with a causal mask aligned to the end of the context.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from native_backend.attention.metadata import AttentionMetadata


def write_kv(
    k: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
    v: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
    cache_k: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim)
    cache_v: torch.Tensor,
    slot_mapping: torch.Tensor,  # (num_tokens,) int64
) -> None:
    flat_k = cache_k.view(-1, *cache_k.shape[2:])  # (num_slots, num_kv_heads, head_dim)
    flat_v = cache_v.view(-1, *cache_v.shape[2:])
    flat_k.index_copy_(0, slot_mapping, k.to(cache_k.dtype))
    flat_v.index_copy_(0, slot_mapping, v.to(cache_v.dtype))


def paged_attention(
    q: torch.Tensor,  # (num_tokens, num_heads, head_dim)
    cache_k: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim)
    cache_v: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # (num_tokens, num_heads, head_dim)
    out = torch.empty_like(q)
    q_lens = metadata.query_lens_cpu
    decode_seqs = [s for s, n in enumerate(q_lens) if n == 1]
    if decode_seqs:
        _decode(out, q, cache_k, cache_v, metadata, scale, decode_seqs)
    if len(decode_seqs) < len(q_lens):
        _prefill(out, q, cache_k, cache_v, metadata, scale, [s for s, n in enumerate(q_lens) if n != 1])
    return out


def _decode(out, q, cache_k, cache_v, md: AttentionMetadata, scale: float, seqs: list[int]) -> None:
    """One query row per sequence; all of them in one padded batch."""
    all_decode = len(seqs) == md.num_seqs
    if all_decode:  # rows are sequences in order: no index bookkeeping
        rows, tables, ctx_lens, max_ctx = slice(None), md.block_tables, md.context_lens, md.max_context_len
    else:
        seq_idx = torch.tensor(seqs, device=q.device)
        rows = md.query_start_loc[seq_idx].long()
        tables, ctx_lens = md.block_tables[seq_idx], md.context_lens[seq_idx]
        max_ctx = max(md.context_lens_cpu[s] for s in seqs)
    num_blocks = -(-max_ctx // md.block_size)
    k = _gather(cache_k, tables[:, :num_blocks], q.dtype)  # (n, ctx, kv_heads, head_dim)
    v = _gather(cache_v, tables[:, :num_blocks], q.dtype)  # (n, ctx, kv_heads, head_dim)
    n, ctx, kv_heads, head_dim = k.shape
    qg = q[rows].view(n, kv_heads, -1, head_dim)  # (n, kv_heads, group, head_dim)
    scores = torch.matmul(qg, k.permute(0, 2, 3, 1)) * scale  # (n, kv_heads, group, ctx)
    pad = torch.arange(ctx, device=q.device)[None, :] >= ctx_lens[:, None]  # (n, ctx)
    scores.masked_fill_(pad[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    o = torch.matmul(probs, v.transpose(1, 2))  # (n, kv_heads, group, head_dim)
    out[rows] = o.reshape(n, -1, head_dim)


def _prefill(out, q, cache_k, cache_v, md: AttentionMetadata, scale: float, seqs: list[int]) -> None:
    """Several query rows per sequence: causal attention over the whole (cached + new) context."""
    start_loc = md.query_start_loc.tolist()
    for s in seqs:
        q_len, ctx = md.query_lens_cpu[s], md.context_lens_cpu[s]
        table = md.block_tables[s, : -(-ctx // md.block_size)]
        k = _gather(cache_k, table[None], q.dtype)[0, :ctx]  # (ctx, kv_heads, head_dim)
        v = _gather(cache_v, table[None], q.dtype)[0, :ctx]
        rows = slice(start_loc[s], start_loc[s] + q_len)
        # Bottom-right causal: query i sits at position ctx - q_len + i.
        q_pos = torch.arange(ctx - q_len, ctx, device=q.device)[:, None]
        mask = torch.arange(ctx, device=q.device)[None, :] <= q_pos  # (q_len, ctx)
        o = F.scaled_dot_product_attention(
            q[rows].transpose(0, 1),  # (num_heads, q_len, head_dim)
            k.transpose(0, 1),  # (kv_heads, ctx, head_dim)
            v.transpose(0, 1),
            attn_mask=mask,
            scale=scale,
            enable_gqa=True,
        )  # (num_heads, q_len, head_dim)
        out[rows] = o.transpose(0, 1)


def _gather(cache: torch.Tensor, tables: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(n, num_blocks) block ids -> (n, num_blocks * block_size, kv_heads, head_dim) in `dtype`."""
    blocks = cache[tables.long()]  # (n, num_blocks, block_size, kv_heads, head_dim)
    return blocks.flatten(1, 2).to(dtype)
