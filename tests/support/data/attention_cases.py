"""Paged-attention test cases shared by the backends' tests: a scrambled paged cache holding every
cached key of a few sequences, the step's metadata, and the dense answer to compare against."""

from __future__ import annotations

import torch

from native_backend.model.attention import reference
from native_backend.model.attention.metadata import AttentionMetadata
from native_backend.model.kv_cache import KVLayer


def make_case(seqs, *, num_kv_heads, group, head_dim=64, block_size=16, cache_dtype=torch.float32, seed=0):
    """seqs: (context_len, query_len) per sequence. Returns q, k_new, v_new, dense k/v per
    sequence, a cache holding every cached (pre-step) key, and the step's metadata."""
    g = torch.Generator().manual_seed(seed)
    needed = sum(-(-ctx // block_size) for ctx, _ in seqs)
    free = (torch.randperm(needed + 8, generator=g) + 1).tolist()  # scrambled; block 0 = padding
    cache_k = torch.zeros(needed + 9, block_size, num_kv_heads, head_dim, dtype=cache_dtype)
    cache_v = torch.zeros_like(cache_k)
    tables, ks, vs, qs, k_new, v_new = [], [], [], [], [], []
    for ctx, q_len in seqs:
        table = [free.pop() for _ in range(-(-ctx // block_size))]
        k = torch.randn(ctx, num_kv_heads, head_dim, generator=g).to(cache_dtype).float()
        v = torch.randn(ctx, num_kv_heads, head_dim, generator=g).to(cache_dtype).float()
        for pos in range(ctx - q_len):
            cache_k[table[pos // block_size], pos % block_size] = k[pos].to(cache_dtype)
            cache_v[table[pos // block_size], pos % block_size] = v[pos].to(cache_dtype)
        tables.append(table)
        ks.append(k)
        vs.append(v)
        k_new.append(k[ctx - q_len:])
        v_new.append(v[ctx - q_len:])
        qs.append(torch.randn(q_len, num_kv_heads * group, head_dim, generator=g))
    md = AttentionMetadata.build(query_lens=[q for _, q in seqs], context_lens=[c for c, _ in seqs],
                                 block_tables=tables, block_size=block_size)
    reference.write_kv(torch.cat(k_new), torch.cat(v_new), KVLayer.of(cache_k, cache_v), md.slot_mapping)
    return torch.cat(qs), ks, vs, cache_k, cache_v, md


def dense(q, ks, vs, md, scale):
    outs, start = [], 0
    for k, v, q_len in zip(ks, vs, md.query_lens_cpu):
        qs = q[start:start + q_len]
        group = qs.shape[1] // k.shape[1]
        k_full, v_full = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", qs, k_full) * scale
        ctx = k.shape[0]
        hidden = torch.arange(ctx)[None, :] > torch.arange(ctx - q_len, ctx)[:, None]
        outs.append(torch.einsum("hqk,khd->qhd", scores.masked_fill(hidden, float("-inf")).softmax(-1), v_full))
        start += q_len
    return torch.cat(outs)
