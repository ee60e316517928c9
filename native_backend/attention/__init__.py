"""Paged attention: write new K/V into cache slots, then attend over the cached blocks.

Two implementations share one signature:

    write_kv(k, v, cache_k, cache_v, slot_mapping)
    paged_attention(q, cache_k, cache_v, metadata, scale) -> (num_tokens, num_heads, head_dim)

`reference` (torch) runs on CPU; `triton_kernels` on CUDA. Triton is imported only when a CUDA
backend is asked for, so CPU-only installs never need it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from native_backend.attention.metadata import AttentionMetadata

__all__ = ["AttentionBackend", "AttentionMetadata", "get_attention_backend"]


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    write_kv: Callable[..., None]
    paged_attention: Callable[..., torch.Tensor]


def get_attention_backend(device: torch.device | str, name: str | None = None) -> AttentionBackend:
    """`name` forces "reference" or "triton"; by default CUDA gets Triton and the CPU the reference."""
    device = torch.device(device)
    name = name or ("triton" if device.type == "cuda" else "reference")
    if name == "reference":
        from native_backend.attention import reference as impl
    elif name == "triton":
        from native_backend.attention import triton_kernels as impl
    else:
        raise ValueError(f"unknown attention backend {name!r}")
    return AttentionBackend(name, impl.write_kv, impl.paged_attention)
