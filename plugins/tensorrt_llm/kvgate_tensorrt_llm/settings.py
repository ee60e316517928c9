"""What a deployment's `settings:` may hold for `backend: tensorrt_llm` (in-process).

Each field maps onto one `tensorrt_llm.LLM(...)` argument (TorchLlmArgs, release 1.2.1); the names
follow TensorRT-LLM's so its documentation applies unchanged.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from gateway.config import format_path

QUANTIZATION_HINT = (
    "TensorRT-LLM's PyTorch backend takes quantization (W4A16 AWQ, FP8, NVFP4) from a "
    "pre-quantized checkpoint: give that checkpoint as `model` (e.g. a ModelOpt AWQ export); "
    "quant_config is refused by LLM() on this backend"
)


class KvCacheSettings(BaseModel):
    """`KvCacheConfig(...)`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    free_gpu_memory_fraction: float = Field(
        0.9, gt=0, le=1, description="Share of the GPU memory left after the weights that holds KV blocks."
    )
    enable_block_reuse: bool = Field(True, description="Prefix caching: reuse KV blocks across requests.")
    dtype: Literal["auto", "fp8"] = Field("auto", description="KV element type; fp8 halves KV memory.")
    tokens_per_block: int = Field(32, gt=0, description="Tokens per KV block.")


class SpeculativeSettings(BaseModel):
    """`speculative_config=`: the decoding config class chosen by `method`, the other keys its fields
    (e.g. `max_draft_len`, `speculative_model`), checked by TensorRT-LLM itself."""

    model_config = ConfigDict(extra="allow", frozen=True)

    method: Literal["ngram", "draft_target", "eagle", "mtp"]


class TrtLlmSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(description="HF model id or checkpoint folder; a pre-quantized one for AWQ/FP8.")
    tokenizer: str | None = Field(None, description="Tokenizer id or folder; default: the model's.")
    tensor_parallel_size: int = Field(1, gt=0, description="GPUs per model replica.")
    dtype: Literal["auto", "float16", "bfloat16", "float32"] = Field("auto", description="Weights/activations.")
    kv_cache: KvCacheSettings = KvCacheSettings()
    speculative: SpeculativeSettings | None = None
    max_batch_size: int | None = Field(None, gt=0, description="Sequences per iteration (TRT-LLM: 2048).")
    max_num_tokens: int | None = Field(None, gt=0, description="Tokens per iteration (TRT-LLM: 8192).")
    enable_chunked_prefill: bool = Field(False, description="Split long prefills across iterations.")
    max_in_flight: int = Field(
        256, gt=0, description="Requests handed to the engine at once; the rest wait in our priority queue."
    )
    default_max_tokens: int = Field(
        1024, gt=0, description="Output limit when a request sets none (TRT-LLM's own default is 32)."
    )
    stats_poll_s: float = Field(1.0, gt=0, description="Seconds between two reads of the iteration stats.")
    stats_stale_s: float = Field(5.0, gt=0, description="Iteration stats older than this are ignored.")

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
        err = exc.errors()[0]
        message = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            message = "unknown key"
        path = format_path(err["loc"])
        # A model-level check (quant_config) has no path; its message starts with the key.
        raise ValueError(f"settings.{path}: {message}" if path else f"settings.{message}") from None
