"""Rotary position embedding: the inverse frequencies (with the config's scaling), the cos/sin
tables computed once at build time, `apply_rope` (Hugging Face's rotate_half convention), and
`unpermute_rotary_rows` (a GGUF's q/k rows back in that convention)."""

from __future__ import annotations

import math

import torch
from torch import nn

from native_backend.config.model import ModelConfig


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """(head_dim // 2,) inverse frequencies, with the config's scaling applied."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":  # positions divided by the factor == frequencies divided by it
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise NotImplementedError(f"rope_scaling type {rope_type!r} is not supported")


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    """Llama 3.1: long wavelengths slowed by `factor`, short ones kept, a smooth ramp between."""
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin tables computed once for every position; a forward step only indexes them."""

    def __init__(self, config: ModelConfig, device=None):
        super().__init__()
        positions = torch.arange(config.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(positions, rope_inv_freq(config))  # (max_pos, head_dim // 2) fp32
        # Computed on the host whatever the device (the same tables everywhere); not persistent:
        # derived from the config, never part of a checkpoint.
        self.register_buffer("cos", freqs.cos().to(device), persistent=False)
        self.register_buffer("sin", freqs.sin().to(device), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Once per step, shared by every layer: (cos, signed sin), each (num_tokens, 1, head_dim),
        laid out for `apply_rope`: cos = [cos | cos], sin = [-sin | sin]."""
        cos = self.cos.index_select(0, positions)  # (num_tokens, head_dim // 2)
        sin = self.sin.index_select(0, positions)
        return torch.cat((cos, cos), dim=-1).unsqueeze(1), torch.cat((-sin, sin), dim=-1).unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (num_tokens, heads, head_dim); cos, sin as `RotaryEmbedding` returns them.

    Rotates pairs (i, i + head_dim/2), Hugging Face's rotate_half: with x = [x1 | x2],
    [x1 cos - x2 sin | x2 cos + x1 sin] = x * [cos | cos] + [x2 | x1] * [-sin | sin],
    and [x2 | x1] is x rolled by half its width.
    """
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin)


def unpermute_rotary_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head row interleave: rows (h, i, pair) -> (h, pair, i).

        llama.cpp rows of one head:  r0 r(d/2) r1 r(d/2+1) ...   (pairs adjacent)
        Hugging Face rows:           r0 r1 ... r(d/2-1) r(d/2) ... (halves)
    """
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
