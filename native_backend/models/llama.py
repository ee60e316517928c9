"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral-style GQA) over a paged KV cache.

The batch is flat: `input_ids` and `positions` are (num_tokens,) with every scheduled sequence's
tokens concatenated; `AttentionMetadata` says where each sequence starts and where its KV lives.
Module and parameter names follow Hugging Face's `LlamaForCausalLM`, so a safetensors state dict
loads as is, and every projection is its own `nn.Linear` so that transforms (tensor-parallel
sharding, int4 weight-only quantization) can swap them without touching this file.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from native_backend.attention import AttentionBackend, AttentionMetadata, get_attention_backend
from native_backend.config import ModelConfig
from native_backend.kv_cache import KVCache
from native_backend.models.layers import TORCH_OPS, RMSNorm, RotaryEmbedding, TorchOps, apply_rope  # noqa: F401


# ------------------------------------------------------------------------------ blocks


@dataclass
class StepContext:
    """What every layer of one forward step shares."""

    rope: object  # ops.rope_tables(...) for the step's positions
    md: AttentionMetadata
    backend: AttentionBackend
    ops: TorchOps


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

    def forward(self, x, kv: tuple[torch.Tensor, torch.Tensor], ctx: StepContext):
        n = x.shape[0]
        q = self.q_proj(x).view(n, self.num_heads, self.head_dim)  # (num_tokens, num_heads, head_dim)
        k = self.k_proj(x).view(n, self.num_kv_heads, self.head_dim)  # (num_tokens, num_kv_heads, head_dim)
        v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)
        q, k = ctx.ops.rope(q, k, ctx.rope)
        cache_k, cache_v = kv
        ctx.backend.write_kv(k, v, cache_k, cache_v, ctx.md.slot_mapping)
        o = ctx.backend.paged_attention(q, cache_k, cache_v, ctx.md, self.scale)  # (num_tokens, num_heads, head_dim)
        return self.o_proj(o.reshape(n, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, ops: TorchOps = TORCH_OPS) -> torch.Tensor:
        return self.down_proj(ops.silu_mul(self.gate_proj(x), self.up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, residual: torch.Tensor | None, delta: torch.Tensor, kv, ctx: StepContext):
        """The stream is carried as (residual, delta of the last block): each add is fused with the
        norm that reads its sum. Returns this layer's (residual, delta)."""
        residual, x = ctx.ops.add_rms_norm(residual, delta, self.input_layernorm)
        delta = self.self_attn(x, kv, ctx)
        residual, x = ctx.ops.add_rms_norm(residual, delta, self.post_attention_layernorm)
        return residual, self.mlp(x, ctx.ops)


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
        self.ops: TorchOps = TORCH_OPS  # a device's fused ops replace these (transforms.kernels)
        # A device's whole-stack decode step (transforms.cpu_decode.FusedDecode), or None: called
        # first, it returns None for any step it does not take.
        self.fused_decode = None

    def forward(
        self,
        input_ids: torch.Tensor,  # (num_tokens,) int64
        positions: torch.Tensor,  # (num_tokens,) int64
        kv_cache: KVCache,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # (num_tokens, hidden) after the final norm
        if self.attn_backend is None:
            self.attn_backend = get_attention_backend(input_ids.device)
        if self.fused_decode is not None:
            hidden = self.fused_decode(input_ids, positions, kv_cache, attn_metadata)
            if hidden is not None:
                return hidden
        ops = self.ops
        ctx = StepContext(ops.rope_tables(self.model.rotary_emb, positions), attn_metadata, self.attn_backend, ops)
        residual, delta = None, self.model.embed_tokens(input_ids)  # (num_tokens, hidden)
        for i, layer in enumerate(self.model.layers):
            residual, delta = layer(residual, delta, kv_cache.layer(i), ctx)
        return ops.add_rms_norm(residual, delta, self.model.norm)[1]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(rows, hidden) -> (rows, vocab) fp32. Pass only the rows that will be sampled."""
        return self.lm_head(hidden).float()
