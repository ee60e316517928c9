"""Paged attention: write new K/V into cache slots, then attend over the cached blocks.

Three implementations share one signature:

    write_kv(k, v, kv, slot_mapping)
    paged_attention(q, kv, metadata, scale) -> (num_tokens, num_heads, head_dim)

where `kv` is the layer's `KVLayer` (its key and value blocks, storage dtype and scales).

`reference` (torch) is the specification and the fallback; `cpu` sends short queries (decode) to
kvgate's C kernel and the rest to the reference, on x86-64 CPUs where the kernels build;
`triton_kernels` runs on CUDA. Triton is imported only when a CUDA backend is asked for, so
CPU-only installs never need it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch

from native_backend.model.attention.metadata import AttentionMetadata

__all__ = ["AttentionBackend", "AttentionMetadata", "get_attention_backend"]


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    write_kv: Callable[..., None]
    paged_attention: Callable[..., torch.Tensor]


def get_attention_backend(device: torch.device | str, name: str | None = None, *,
                          prefill_bf16: bool = False) -> AttentionBackend:
    """`name` forces "reference", "cpu" or "triton"; by default CUDA gets Triton, and the CPU gets
    "cpu" where kvgate's C kernels are available, else the reference. `prefill_bf16`: "cpu"'s
    prompt chunks with bf16 products (layers/prefill_attention.py; the others ignore it)."""
    device = torch.device(device)
    name = name or ("triton" if device.type == "cuda" else _default_cpu_backend())
    if name == "reference":
        from native_backend.model.attention import reference as impl
    elif name == "cpu":
        from native_backend.model.attention import cpu as impl
    elif name == "triton":
        from native_backend.model.attention import triton_kernels as impl
    else:
        raise ValueError(f"unknown attention backend {name!r}")
    if prefill_bf16 and name == "cpu":
        return AttentionBackend(name, impl.write_kv, functools.partial(impl.paged_attention, prefill_bf16=True))
    return AttentionBackend(name, impl.write_kv, impl.paged_attention)


def _default_cpu_backend() -> str:
    from native_backend.kernels import cpu_kernels

    return "cpu" if cpu_kernels.available() else "reference"
