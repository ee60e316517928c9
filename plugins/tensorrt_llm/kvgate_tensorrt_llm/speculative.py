"""`speculative:` settings: one strict model per method the 1.2 PyTorch backend runs.

TensorRT-LLM's decoding configs are strict pydantic models (tensorrt_llm/llmapi/llm_args.py:
`DecodingBaseConfig(StrictBaseModel)` and its subclasses), so a misspelt field or a zero draft
length fails when `LLM(...)` is built, on the GPU node, minutes into a start. These models carry
the same fields and limits so `kvgate check-config` finds those mistakes first.

    method        TensorRT-LLM class            required
    eagle3        EagleDecodingConfig           max_draft_len > 0, speculative_model (EAGLE-3 head)
    ngram         NGramDecodingConfig           max_draft_len > 0
    draft_target  DraftTargetDecodingConfig     max_draft_len > 0, speculative_model
    mtp           MTPDecodingConfig             (num_nextn_predict_layers, default 1)

On the PyTorch backend `EagleDecodingConfig` *is* EAGLE-3 (its spec_dec_mode is EAGLE3 or
EAGLE3_ONE_MODEL); Medusa and Lookahead report `supports_backend("pytorch") == False`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, PositiveInt

TRT_CLASSES = {
    "eagle3": "EagleDecodingConfig",
    "ngram": "NGramDecodingConfig",
    "draft_target": "DraftTargetDecodingConfig",
    "mtp": "MTPDecodingConfig",
}
REFUSED = {
    "eagle": "the PyTorch backend runs EAGLE-3 only: use method 'eagle3' with an EAGLE-3 draft head",
    "medusa": "Medusa runs on TensorRT-LLM's TensorRT engine backend only, not the PyTorch backend",
    "lookahead": "Lookahead runs on TensorRT-LLM's TensorRT engine backend only, not the PyTorch backend",
}


class _Method(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    max_concurrency: NonNegativeInt | None = Field(
        None, description="Speculate only while at most this many requests run (None: always).")

    def trt_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of the TensorRT-LLM class; unset optional fields keep its defaults."""
        kwargs = self.model_dump(exclude={"method"}, exclude_none=True)
        if "speculative_model" in kwargs:
            # Both the 1.x name and the newer one are accepted upstream through this alias.
            kwargs["speculative_model_dir"] = kwargs.pop("speculative_model")
        return kwargs


class Eagle3(_Method):
    method: Literal["eagle3"]
    max_draft_len: PositiveInt = Field(description="Draft tokens proposed per step.")
    speculative_model: str = Field(description="The EAGLE-3 draft head: HF id or folder.")
    eagle3_one_model: bool = Field(True, description="Run the draft head inside the target's step.")


class NGram(_Method):
    method: Literal["ngram"]
    max_draft_len: PositiveInt = Field(description="Draft tokens proposed per step.")
    max_matching_ngram_size: PositiveInt = Field(2, description="Longest suffix matched against the pool.")
    is_keep_all: bool = True
    is_use_oldest: bool = True
    is_public_pool: bool = Field(True, description="One n-gram pool for all requests.")


class DraftTarget(_Method):
    method: Literal["draft_target"]
    max_draft_len: PositiveInt = Field(description="Draft tokens proposed per step.")
    speculative_model: str = Field(description="The draft model: HF id or folder.")


class MTP(_Method):
    method: Literal["mtp"]
    num_nextn_predict_layers: PositiveInt = Field(1, description="MTP modules, one draft token each.")
    use_relaxed_acceptance_for_thinking: bool = False
    relaxed_topk: PositiveInt = 1
    relaxed_delta: float = Field(0.0, ge=0)


SpeculativeSettings = Annotated[Union[Eagle3, NGram, DraftTarget, MTP], Field(discriminator="method")]


def check_method(value: Any) -> Any:
    """A clear refusal for methods the PyTorch backend does not run, before the union's own
    "does not match any of the expected tags"."""
    if isinstance(value, dict):
        method = value.get("method")
        if method in REFUSED:
            raise ValueError(f"method '{method}': {REFUSED[method]}")
        if method not in TRT_CLASSES:
            shown = "missing" if method is None else f"'{method}'"
            raise ValueError(f"method {shown}: choose one of {', '.join(TRT_CLASSES)}")
    return value


def speculative_config(spec: _Method, llmapi) -> object:
    """The TensorRT-LLM config object for validated settings."""
    return getattr(llmapi, TRT_CLASSES[spec.method])(**spec.trt_kwargs())
