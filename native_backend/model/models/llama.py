"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral-style GQA) over a paged KV cache, built in
its final form from a `LayerContext`.

The batch is flat: `input_ids` and `positions` are (num_tokens,) with every scheduled sequence's
tokens concatenated; `AttentionMetadata` says where each sequence starts and where its KV lives.
Module and parameter names follow Hugging Face's `LlamaForCausalLM`, so checkpoint tensors map
onto parameters by name (`load_weights`), each through its own `weight_loader`.

    build:  LlamaForCausalLM(config, ctx)        layers created with ctx's linear method and shard
    load:   model.load_weights(named tensors)    one checkpoint tensor at a time
            model.process_weights_after_loading()
    serve:  model.bind_kv_cache(cache)           each attention layer takes its KVLayer
            model(input_ids, positions, md) -> hidden;  model.compute_logits(hidden rows)

A pipeline stage (ctx.stage) builds and loads only its decoder layers (the others are empty
placeholders, so parameter names stay the checkpoint's), the embedding on the first stage, the
final norm and LM head on the last; a stage after the first takes the previous one's (residual,
delta) as `intermediate`, and a stage before the last returns its own instead of hidden states.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from native_backend.config.model import ModelConfig
from native_backend.model.attention import AttentionMetadata
from native_backend.model.kv_cache import KVCache
from native_backend.model.layers.attention import Attention
from native_backend.model.layers.context import LayerContext
from native_backend.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from native_backend.model.layers.linear import ColumnParallelLinear, LinearBase, RowParallelLinear
from native_backend.model.layers.norm import RMSNorm
from native_backend.model.layers.ops import TorchOps
from native_backend.model.layers.rotary import RotaryEmbedding
from native_backend.model.layers.sharding import default_weight_loader, materialize


@dataclass
class StepContext:
    """What every layer of one forward step shares."""

    rope: object  # ops.rope_tables(...) for the step's positions
    md: AttentionMetadata
    ops: TorchOps


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, ctx: LayerContext):
        super().__init__()
        shard, hd = ctx.shard, config.head_dim
        kv_shard = shard.kv_head_shard(config.num_kv_heads)  # split, or replicated with fewer heads than ranks
        self.num_heads = shard.part(config.num_heads, "attention heads")
        self.num_kv_heads = kv_shard.part(config.num_kv_heads, "KV heads")
        self.head_dim = hd
        hidden, bias = config.hidden_size, config.attention_bias
        common = dict(method=ctx.linear_method, dtype=ctx.dtype, device=ctx.device)
        self.q_proj = ColumnParallelLinear(hidden, config.num_heads * hd, bias=bias, shard=shard, **common)
        self.k_proj = ColumnParallelLinear(hidden, config.num_kv_heads * hd, bias=bias, shard=kv_shard, **common)
        self.v_proj = ColumnParallelLinear(hidden, config.num_kv_heads * hd, bias=bias, shard=kv_shard, **common)
        common["shard"] = shard
        self.o_proj = RowParallelLinear(config.num_heads * hd, hidden, bias=bias, **common)
        self.attn = Attention(self.num_heads, self.num_kv_heads, hd, ctx.attention)

    def forward(self, x: torch.Tensor, step: StepContext) -> torch.Tensor:
        n = x.shape[0]
        q = self.q_proj(x).view(n, self.num_heads, self.head_dim)  # (num_tokens, num_heads, head_dim)
        k = self.k_proj(x).view(n, self.num_kv_heads, self.head_dim)  # (num_tokens, num_kv_heads, head_dim)
        v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)
        q, k = step.ops.rope(q, k, step.rope)
        o = self.attn(q, k, v, step.md)  # (num_tokens, num_heads, head_dim)
        return self.o_proj(o.reshape(n, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig, ctx: LayerContext):
        super().__init__()
        common = dict(bias=False, method=ctx.linear_method, shard=ctx.shard, dtype=ctx.dtype, device=ctx.device)
        self.gate_proj = ColumnParallelLinear(config.hidden_size, config.intermediate_size, **common)
        self.up_proj = ColumnParallelLinear(config.hidden_size, config.intermediate_size, **common)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, **common)

    def forward(self, x: torch.Tensor, ops: TorchOps) -> torch.Tensor:
        return self.down_proj(ops.silu_mul(self.gate_proj(x), self.up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, ctx: LayerContext):
        super().__init__()
        norm = dict(dtype=ctx.dtype, device=ctx.device)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **norm)
        self.self_attn = LlamaAttention(config, ctx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **norm)
        self.mlp = LlamaMLP(config, ctx)

    def forward(self, residual: torch.Tensor | None, delta: torch.Tensor, step: StepContext):
        """The stream is carried as (residual, delta of the last block): each add is fused with the
        norm that reads its sum. Returns this layer's (residual, delta)."""
        residual, x = step.ops.add_rms_norm(residual, delta, self.input_layernorm)
        delta = self.self_attn(x, step)
        residual, x = step.ops.add_rms_norm(residual, delta, self.post_attention_layernorm)
        return residual, self.mlp(x, step.ops)


class MissingLayer(nn.Module):
    """A decoder layer another pipeline stage holds: no parameters, never run."""


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, ctx: LayerContext):
        super().__init__()
        stage = ctx.stage
        self.embed_tokens = None  # a middle stage's; the last stage's with a tied head keeps it for the head
        if stage.first or (stage.last and config.tie_word_embeddings):
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, shard=ctx.shard,
                                                       dtype=ctx.dtype, device=ctx.device)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, ctx) if stage.holds(i, config.num_layers)
                                    else MissingLayer() for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=ctx.dtype, device=ctx.device) \
            if stage.last else None
        self.rotary_emb = RotaryEmbedding(config, device=ctx.device)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, ctx: LayerContext):
        super().__init__()
        self.config = config
        self.ctx = ctx
        self.model = LlamaModel(config, ctx)
        tie_to = self.model.embed_tokens if config.tie_word_embeddings else None
        head_method = ctx.head_method or ctx.linear_method  # int4 models keep a float head
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, method=head_method, shard=ctx.shard,
                                      dtype=ctx.dtype, device=ctx.device, tie_to=tie_to) if ctx.stage.last else None
        self.layer_range = ctx.stage.layer_range(config.num_layers)  # the decoder layers this stage runs
        self.ops: TorchOps = ctx.ops
        # CPU: a decode step's whole stack in one C call (models.fused_decode), made once the KV
        # cache is bound; None: every step runs the layers below.
        self.fused_decode = None

    # ------------------------------------------------------------------ loading

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Hugging Face-named checkpoint tensors, one at a time, each into its parameter through
        the parameter's `weight_loader`. Raises on a missing or unexpected tensor."""
        params = dict(self.named_parameters(remove_duplicate=False))
        tied = {"lm_head.weight"} if self.config.tie_word_embeddings else set()
        loaded, unexpected = set(), []
        self.checkpoint_kv_scales = {}
        for name, tensor in weights:
            if name in tied:  # some tied checkpoints carry the head too: the embedding's copy wins
                continue
            if _take_kv_scale(self.checkpoint_kv_scales, name, tensor) or not self._holds(name):
                continue  # a KV scale, or a tensor of another pipeline stage's
            param = params.get(name)
            if param is None:
                unexpected.append(name)
                continue
            try:
                getattr(param, "weight_loader", default_weight_loader)(param, tensor)
            except ValueError as exc:  # a corrupt or mismatched checkpoint: say which tensor
                raise ValueError(f"checkpoint tensor {name}: {exc}") from None
            loaded.add(name)
        missing = sorted(set(params) - loaded - tied)
        if missing or unexpected:
            raise ValueError(f"checkpoint does not match the model: missing {missing}, unexpected {unexpected}")

    def _holds(self, name: str) -> bool:
        """Whether this stage has the parameter of this checkpoint name (every one, with one stage)."""
        part = name.split(".")
        if part[:2] == ["model", "layers"]:
            return int(part[2]) in self.layer_range
        if part[:2] == ["model", "embed_tokens"]:
            return self.model.embed_tokens is not None
        if part[:2] == ["model", "norm"]:
            return self.model.norm is not None
        return self.lm_head is not None if part[0] == "lm_head" else True

    def kv_scales_from_checkpoint(self) -> list[tuple[float, float]] | None:
        """Per-layer (k_scale, v_scale) of this stage's layers when the checkpoint had both for each."""
        scales = self.checkpoint_kv_scales
        try:
            return [(scales[(i, "k")], scales[(i, "v")]) for i in self.layer_range]
        except KeyError:
            return None

    def process_weights_after_loading(self) -> None:
        for module in self.modules():
            if isinstance(module, LinearBase):
                module.process_weights_after_loading()
        self.eval().requires_grad_(False)

    def decoder_layers(self) -> list[LlamaDecoderLayer]:
        """This stage's decoder layers (every one, with one stage), in order (what FusedDecode walks)."""
        return [self.model.layers[i] for i in self.layer_range]

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.decoder_layers()]

    def bind_kv_cache(self, cache: KVCache) -> None:
        """Give every attention layer its slice of the cache; a CPU model that can fuse decode
        steps builds their pointer table now (weights and cache stay where they are from here)."""
        layers = self.attention_layers()
        if cache.num_layers != len(layers):
            raise ValueError(f"a KV cache of {cache.num_layers} layers for a model of {len(layers)}")
        for attn, kv in zip(layers, cache.layers):
            attn.bind(kv)
        self.fused_decode = None
        if self.ctx.fuse_decode:
            from native_backend.model.models.fused_decode import FusedDecode

            self.fused_decode = FusedDecode.build(self)

    # ------------------------------------------------------------------ running

    def forward(
        self,
        input_ids: torch.Tensor,  # (num_tokens,) int64
        positions: torch.Tensor,  # (num_tokens,) int64
        attn_metadata: AttentionMetadata,
        intermediate: tuple[torch.Tensor, torch.Tensor] | None = None,  # the previous stage's (residual, delta)
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """(num_tokens, hidden) after the final norm; a stage before the last: its (residual, delta)."""
        if self.fused_decode is not None:
            hidden = self.fused_decode(input_ids, positions, attn_metadata)
            if hidden is not None:
                return hidden
        ops = self.ops
        step = StepContext(ops.rope_tables(self.model.rotary_emb, positions), attn_metadata, ops)
        if intermediate is None:
            residual, delta = None, self.model.embed_tokens(input_ids)  # (num_tokens, hidden)
        else:
            residual, delta = intermediate
        for layer in self.decoder_layers():
            residual, delta = layer(residual, delta, step)
        if self.model.norm is None:
            return residual, delta
        return ops.add_rms_norm(residual, delta, self.model.norm)[1]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """(rows, hidden) -> (rows, vocab) fp32. Pass only the rows that will be sampled.
        Tensor-parallel: each rank scores its slice of the vocabulary and rank 0 gathers them;
        the other ranks get None (they do not sample)."""
        logits = self.lm_head(hidden)
        if self.ctx.shard.size > 1:
            logits = self.ctx.shard.gather_last_dim(logits)
            if logits is None:
                return None
        return logits.float()


# fp8 KV scales as checkpoints carry them (vLLM's and llm-compressor's names), one number each.
_KV_SCALE_NAMES = {"self_attn.k_scale": "k", "self_attn.v_scale": "v",
                   "self_attn.k_proj.output_scale": "k", "self_attn.v_proj.output_scale": "v"}


def _take_kv_scale(scales: dict, name: str, tensor: torch.Tensor) -> bool:
    """Keep `model.layers.N.<kv scale>` in `scales[(N, "k"|"v")]`; False for any other tensor."""
    parts = name.split(".", 3)
    if len(parts) < 4 or parts[:2] != ["model", "layers"] or parts[3] not in _KV_SCALE_NAMES:
        return False
    scales[(int(parts[2]), _KV_SCALE_NAMES[parts[3]])] = float(materialize(tensor).float().max())
    return True
