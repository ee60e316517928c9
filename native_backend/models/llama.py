"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral-style GQA) over a paged KV cache.

The batch is flat: `input_ids` and `positions` are (num_tokens,) with every scheduled sequence's
tokens concatenated; `AttentionMetadata` says where each sequence starts and where its KV lives.
Module and parameter names follow Hugging Face's `LlamaForCausalLM`, so a safetensors state dict
loads as is, and every projection is its own `nn.Linear` so that transforms (tensor-parallel
sharding, int4 weight-only quantization) can swap them without touching this file.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from native_backend.attention import AttentionBackend, AttentionMetadata, get_attention_backend
from native_backend.config import ModelConfig
from native_backend.kv_cache import KVCache


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


# ------------------------------------------------------------------------------ blocks


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = self.head_dim**-0.5
        hidden, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)

    def forward(self, x, rope, kv: tuple[torch.Tensor, torch.Tensor], md: AttentionMetadata, backend):
        n = x.shape[0]
        q = self.q_proj(x).view(n, self.num_heads, self.head_dim)  # (num_tokens, num_heads, head_dim)
        k = self.k_proj(x).view(n, self.num_kv_heads, self.head_dim)  # (num_tokens, num_kv_heads, head_dim)
        v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        cache_k, cache_v = kv
        backend.write_kv(k, v, cache_k, cache_v, md.slot_mapping)
        o = backend.paged_attention(q, cache_k, cache_v, md, self.scale)  # (num_tokens, num_heads, head_dim)
        return self.o_proj(o.reshape(n, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        if torch.is_grad_enabled():  # autograd needs the intermediate tensors intact
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(gate, inplace=True).mul_(up))  # no temporaries: inference


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, h, rope, kv, md, backend):
        h = h + self.self_attn(self.input_layernorm(h), rope, kv, md, backend)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, attn_backend: AttentionBackend | None = None):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.attn_backend = attn_backend  # None: chosen from the input's device on first use

    def forward(
        self,
        input_ids: torch.Tensor,  # (num_tokens,) int64
        positions: torch.Tensor,  # (num_tokens,) int64
        kv_cache: KVCache,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # (num_tokens, hidden) after the final norm
        if self.attn_backend is None:
            self.attn_backend = get_attention_backend(input_ids.device)
        rope = self.model.rotary_emb(positions)  # shared by every layer
        h = self.model.embed_tokens(input_ids)  # (num_tokens, hidden)
        for i, layer in enumerate(self.model.layers):
            h = layer(h, rope, kv_cache.layer(i), attn_metadata, self.attn_backend)
        return self.model.norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(rows, hidden) -> (rows, vocab) fp32. Pass only the rows that will be sampled."""
        return self.lm_head(hidden).float()
