"""The model's shape, read from a Hugging Face `config.json` or from GGUF metadata.

Only what the Llama-family decoder needs; everything else in those files is ignored. RoPE scaling
is kept in Hugging Face's dict form (`{"rope_type": "llama3", "factor": 8.0, ...}`) so a config
read from either source means the same thing to `models.llama.rope_inv_freq`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

# Hugging Face config keys that name a RoPE parameter rather than a scaling setting.
_ROPE_NON_SCALING_KEYS = {"rope_theta", "partial_rotary_factor"}


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int  # query heads
    num_kv_heads: int  # < num_heads under grouped-query attention
    head_dim: int
    intermediate_size: int  # SwiGLU inner width
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # None: plain RoPE; else HF's dict with "rope_type"
    max_position_embeddings: int = 2048  # the context length the model was trained for
    tie_word_embeddings: bool = False  # lm_head shares the embedding matrix
    attention_bias: bool = False  # q/k/v/o projections carry a bias (Qwen2-style: q/k/v only)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()  # some models end on any of several ids
    # What the checkpoint says it is: HF config.json's `model_type`, a GGUF's `general.architecture`
    # (the same names: "llama", "mistral", "qwen2", ...). The model registry builds the class for it.
    architecture: str = "llama"

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    # ---------------------------------------------------------------- Hugging Face config.json

    @classmethod
    def from_hf_dir(cls, path: str) -> ModelConfig:
        with open(os.path.join(path, "config.json")) as f:
            return cls.from_hf_dict(json.load(f))

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        num_heads = d["num_attention_heads"]
        rope_theta, rope_scaling = _hf_rope(d)
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=d.get("num_key_value_heads") or num_heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // num_heads,
            intermediate_size=d["intermediate_size"],
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            tie_word_embeddings=d.get("tie_word_embeddings", False),
            attention_bias=d.get("attention_bias", False),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=_as_id_tuple(d.get("eos_token_id")),
            architecture=str(d.get("model_type") or ""),
        )

    # ---------------------------------------------------------------- GGUF metadata

    @classmethod
    def from_gguf(cls, reader) -> ModelConfig:
        """`reader` is a `gguf.GGUFReader`; keys are `<arch>.<name>` (llama.cpp's convention)."""
        arch = _field(reader, "general.architecture")
        get = lambda key, default=None: _field(reader, f"{arch}.{key}", default)  # noqa: E731
        num_heads = int(get("attention.head_count"))
        hidden = int(get("embedding_length"))
        tensor_names = {t.name for t in reader.tensors}
        vocab = get("vocab_size") or len(_field(reader, "tokenizer.ggml.tokens"))
        return cls(
            vocab_size=int(vocab),
            hidden_size=hidden,
            num_layers=int(get("block_count")),
            num_heads=num_heads,
            num_kv_heads=int(get("attention.head_count_kv", num_heads)),
            head_dim=int(get("rope.dimension_count") or hidden // num_heads),
            intermediate_size=int(get("feed_forward_length")),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            rope_scaling=_gguf_rope_scaling(get),
            max_position_embeddings=int(get("context_length", 2048)),
            # llama.cpp omits output.weight when the head is tied to the embedding.
            tie_word_embeddings="output.weight" not in tensor_names,
            attention_bias="blk.0.attn_q.bias" in tensor_names,
            bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
            eos_token_ids=_as_id_tuple(_field(reader, "tokenizer.ggml.eos_token_id")),
            architecture=str(arch),
        )


def _hf_rope(d: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """transformers >= 5 writes `rope_parameters` (theta inside); older files `rope_scaling`."""
    params = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", d.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    scaling = {k: v for k, v in params.items() if k not in _ROPE_NON_SCALING_KEYS and k != "type"}
    scaling["rope_type"] = rope_type
    return theta, scaling


def _gguf_rope_scaling(get) -> dict[str, Any] | None:
    rope_type = get("rope.scaling.type")
    if rope_type in (None, "none"):
        return None
    scaling: dict[str, Any] = {"rope_type": rope_type, "factor": float(get("rope.scaling.factor", 1.0))}
    original = get("rope.scaling.original_context_length")
    if original is not None:
        scaling["original_max_position_embeddings"] = int(original)
    return scaling


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _as_id_tuple(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return (int(value),)
