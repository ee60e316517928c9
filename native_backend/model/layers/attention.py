"""The attention layer: writes this step's K/V into the layer's own slice of the paged cache,
then attends over it, through the backend its `LayerContext` chose.

    q (num_tokens, num_heads, head_dim), k, v (num_tokens, num_kv_heads, head_dim)  -- this rank's heads
    kv: KVLayer  -- bound once the cache is allocated (`bind`); the backends read its dtype and scales
"""

from __future__ import annotations

import torch
from torch import nn

from native_backend.model.attention import AttentionBackend, AttentionMetadata
from native_backend.model.kv_cache import KVLayer


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, backend: AttentionBackend):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5
        self.backend = backend
        self.kv: KVLayer | None = None

    def bind(self, kv: KVLayer) -> None:
        if (kv.num_kv_heads, kv.head_dim) != (self.num_kv_heads, self.head_dim):
            raise ValueError(f"KV layer of {kv.num_kv_heads} heads x {kv.head_dim} for an attention layer of "
                             f"{self.num_kv_heads} KV heads x {self.head_dim}")
        self.kv = kv

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        kv = self.kv
        if kv is None:
            raise RuntimeError("attention layer has no KV cache bound (model.bind_kv_cache)")
        if kv.k_offset is not None:  # softmax(q . (k - c)) == softmax(q . k): kv_cache.KVLayer.k_offset
            k = k - kv.k_offset.to(k.dtype)
        self.backend.write_kv(k, v, kv, md.slot_mapping)
        return self.backend.paged_attention(q, kv, md, self.scale)  # (num_tokens, num_heads, head_dim)
