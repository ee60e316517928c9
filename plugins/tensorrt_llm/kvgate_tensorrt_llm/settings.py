"""What a deployment's `settings:` may hold for `backend: tensorrt_llm` (in-process).

Each field maps onto one `tensorrt_llm.LLM(...)` argument (TorchLlmArgs, release 1.2.x); the names
follow TensorRT-LLM's so its documentation applies unchanged. The nested sections mirror
TensorRT-LLM's own strict config classes (unknown fields and out-of-range values refused), so
`kvgate check-config` catches what `LLM(...)` would refuse minutes into a start on a GPU node.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, ValidationError, field_validator, model_validator

from gateway.config import settings_error
from kvgate_tensorrt_llm.speculative import SpeculativeSettings, check_method

QUANTIZATION_HINT = (
    "TensorRT-LLM's PyTorch backend takes quantization (W4A16 AWQ, FP8, NVFP4) from a "
    "pre-quantized checkpoint: give that checkpoint as `model` (e.g. a ModelOpt AWQ export); "
    "quant_config is refused by LLM() on this backend"
)


class KvCacheSettings(BaseModel):
    """`KvCacheConfig(...)` (tensorrt_llm/llmapi/llm_args.py, a StrictBaseModel)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    free_gpu_memory_fraction: float = Field(
        0.9, gt=0, le=1, description="Share of the GPU memory left after the weights that holds KV blocks."
    )
    max_tokens: PositiveInt | None = Field(None, description="At most this many tokens of KV cache.")
    enable_block_reuse: bool = Field(True, description="Prefix caching: reuse KV blocks across requests.")
    dtype: Literal["auto", "fp8"] = Field("auto", description="KV element type; fp8 halves KV memory.")
    tokens_per_block: PositiveInt = Field(32, description="Tokens per KV block.")


class TrtLlmSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(description="HF model id or checkpoint folder; a pre-quantized one for AWQ/FP8.")
    tokenizer: str | None = Field(None, description="Tokenizer id or folder; default: the model's.")
    tensor_parallel_size: PositiveInt = Field(1, description="GPUs per model replica.")
    dtype: Literal["auto", "float16", "bfloat16", "float32"] = Field("auto", description="Weights/activations.")
    kv_cache: KvCacheSettings = KvCacheSettings()
    speculative: SpeculativeSettings | None = Field(None, description="Speculative decoding; see speculative.py.")
    max_batch_size: PositiveInt | None = Field(None, description="Sequences per iteration (TRT-LLM: 2048).")
    max_num_tokens: PositiveInt | None = Field(None, description="Tokens per iteration (TRT-LLM: 8192).")
    max_seq_len: PositiveInt | None = Field(
        None, description="Prompt + output tokens per request; default: the checkpoint's context length."
    )
    enable_chunked_prefill: bool = Field(False, description="Split long prefills across iterations.")
    max_in_flight: PositiveInt = Field(
        256, description="Requests handed to the engine at once; the rest wait in our priority queue."
    )
    default_max_tokens: PositiveInt = Field(
        1024, description="Output limit when a request sets none, capped by what the context has left "
        "(TRT-LLM's own default is 32)."
    )
    stats_poll_s: float = Field(1.0, gt=0, description="Seconds between two reads of the iteration stats.")
    stats_stale_s: float = Field(5.0, gt=0, description="Iteration stats older than this are ignored.")

    _speculative_method = field_validator("speculative", mode="before")(check_method)

    @model_validator(mode="before")
    @classmethod
    def _no_quant_config(cls, data: Any):
        if isinstance(data, dict):
            for key in ("quant_config", "quantization"):
                if key in data:
                    raise ValueError(f"{key}: {QUANTIZATION_HINT}")
        return data


def parse_settings(settings: dict) -> TrtLlmSettings:
    try:
        return TrtLlmSettings.model_validate(settings)
    except ValidationError as exc:
        raise settings_error(exc, _without_union_tags) from None


def _without_union_tags(loc: tuple) -> tuple:
    """pydantic puts the chosen union member's tag in the path (`speculative.ngram.max_draft_len`);
    the YAML has no such level."""
    return tuple(part for i, part in enumerate(loc) if not (i > 0 and loc[i - 1] == "speculative"))
