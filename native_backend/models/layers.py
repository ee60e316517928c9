"""The decoder's small operations: RMSNorm, rotary embedding, SwiGLU's gate, and `TorchOps`.

A decoder layer calls its norms, its rotary embedding and its gate through an ops object, so that
a device can bring fused kernels without a second model: `TorchOps` (here) is the reference and
the default; `transforms.cpu_ops.KernelOps` runs them through kvgate's C kernels on x86-64 CPUs.
The residual stream is carried with the norm that follows each add (`add_rms_norm`), which is
where a fused kernel saves a pass.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from native_backend.config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # One fused kernel; the same arithmetic as the lines below (weight * x * rsqrt(...)).
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Normalise in fp32 whatever the model dtype, as the reference implementation does.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


# ------------------------------------------------------------------------------ rotary embedding


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

    def __init__(self, config: ModelConfig):
        super().__init__()
        positions = torch.arange(config.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(positions, rope_inv_freq(config))  # (max_pos, head_dim // 2)
        # Not persistent: derived from the config, never part of a checkpoint.
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

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


# ------------------------------------------------------------------------------ ops


class TorchOps:
    """The reference implementation of every op a layer calls through `ops`."""

    name = "torch"

    def add_rms_norm(self, residual: torch.Tensor | None, delta: torch.Tensor, norm: RMSNorm):
        """(residual + delta, norm(residual + delta)); residual None: delta starts the stream (the
        embeddings)."""
        h = delta if residual is None else residual + delta
        return h, norm(h)

    def rope_tables(self, rotary: RotaryEmbedding, positions: torch.Tensor):
        """Once per step, whatever `rope` needs for these positions (shared by every layer)."""
        return rotary(positions)

    def rope(self, q: torch.Tensor, k: torch.Tensor, tables) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = tables
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """SwiGLU's silu(gate) * up."""
        if torch.is_grad_enabled():  # autograd needs the intermediate tensors intact
            return F.silu(gate) * up
        return F.silu(gate, inplace=True).mul_(up)  # no temporaries: inference


TORCH_OPS = TorchOps()
