"""Quantized KV storage in torch: the specification the C and Triton kernels match bit for bit.

    fp8 (per layer):   stored = fp8(clamp(x / scale, -max, max))   (round to nearest even)
                       read   = float(stored) * scale
    int8 (per token and KV head, over head_dim):
                       s = max|x| / 127;  stored = clamp(round(x / s), -127, 127)   (s = 0: stored 0)
                       read   = stored * s

Divisions are true float32 divisions (not multiplications by a reciprocal) so that every
implementation rounds alike.
"""

from __future__ import annotations

import functools

import torch

from native_backend.model.kv_cache import KVCacheDType


def quantize(x: torch.Tensor, dtype: KVCacheDType, layer_scale: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x (num_tokens, kv_heads, head_dim) -> (stored in dtype.storage, int8's scales (num_tokens,
    kv_heads) float32 or None)."""
    x = x.float()
    if dtype.scaling == "per_layer":
        return (x / layer_scale).clamp_(-dtype.max_value, dtype.max_value).to(dtype.storage), None
    if dtype.scaling == "per_token_head":
        scales = x.abs().amax(dim=-1) / dtype.max_value  # (num_tokens, kv_heads)
        safe = torch.where(scales == 0, torch.ones_like(scales), scales)
        stored = torch.round(x / safe[..., None]).clamp_(-dtype.max_value, dtype.max_value).to(torch.int8)
        return stored, scales
    return x.to(dtype.storage), None


def count_clamped(x: torch.Tensor, dtype: KVCacheDType, layer_scale: float) -> torch.Tensor:
    """(kv_heads,) int64: the values of x (num_tokens, kv_heads, head_dim) that `quantize` clamps
    (beyond the format's range after the per-layer scale), per KV head."""
    return ((x.float() / layer_scale).abs() > dtype.max_value).sum(dim=(0, 2))


def dequantize(stored: torch.Tensor, scales: torch.Tensor | None, dtype: KVCacheDType, layer_scale: float,
               out_dtype: torch.dtype) -> torch.Tensor:
    """The inverse: stored (..., head_dim) [and int8 scales (...)] -> out_dtype."""
    if dtype.scaling == "per_layer":
        return (fp8_lut(dtype.storage, stored.device)[stored.view(torch.uint8).long()] * layer_scale).to(out_dtype)
    if dtype.scaling == "per_token_head":
        return (stored.float() * scales[..., None]).to(out_dtype)
    return stored.to(out_dtype)


@functools.cache
def fp8_lut(storage: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """(256,) float32: the value of every fp8 byte (torch's own decoding). Reading through this
    table is how the C and Triton kernels decode: torch's fp8 -> fp32 cast is ~15x slower than
    bf16's on the CPU."""
    return torch.arange(256, dtype=torch.uint8).view(storage).float().to(device)


FP8_STORAGE = (torch.float8_e4m3fn, torch.float8_e5m2)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """An fp8 tensor viewed as uint8, which every indexing op takes (fp8 has few ops on the CPU)."""
    return t.view(torch.uint8) if t.dtype in FP8_STORAGE else t
