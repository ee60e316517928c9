"""The TensorRT-LLM stand-in (tests/support/fakes/trtllm_standin.py) against the real `tensorrt_llm`.

The adapter's tests run against the stand-in, so they are only as true as it is. Where the real
package imports (a GPU machine with TensorRT-LLM: the GPU tier, bench/gpu_check.py runs this file
with KVGATE_REQUIRE_TRTLLM=1), every field, keyword and default the stand-in declares must be the
real one's: a config field renamed or a default changed upstream fails here instead of leaving
the adapter's tests green against a copy of an old release. Elsewhere the comparison skips with
the reason; its positive control (a stand-in with one default changed is caught) runs everywhere.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import types

import pytest

from tests.support.fakes import trtllm_standin as standin
from tests.support.checks.skips import required

CONFIGS = ("KvCacheConfig", "NGramDecodingConfig", "DraftTargetDecodingConfig", "EagleDecodingConfig",
           "MTPDecodingConfig", "MedusaDecodingConfig")
MISSING = object()


def pydantic_defaults(cls) -> dict:
    return {name: f.get_default(call_default_factory=True) for name, f in cls.model_fields.items()}


def dataclass_defaults(cls) -> dict:
    def default(f):
        if f.default is not dataclasses.MISSING:
            return f.default
        return f.default_factory() if f.default_factory is not dataclasses.MISSING else MISSING
    return {f.name: default(f) for f in dataclasses.fields(cls)}


def signature_defaults(fn) -> dict:
    return {name: (MISSING if p.default is inspect.Parameter.empty else p.default)
            for name, p in inspect.signature(fn).parameters.items() if name != "self"}


def compare(what: str, ours: dict, theirs: dict) -> list[str]:
    """Every name the stand-in declares exists upstream with the same default."""
    problems = []
    for name, default in ours.items():
        if name not in theirs:
            problems.append(f"{what}: no {name!r} upstream")
        elif not _same(default, theirs[name]):
            problems.append(f"{what}.{name}: default {default!r} here, {theirs[name]!r} upstream")
    return problems


def _same(a, b) -> bool:
    if a is MISSING or b is MISSING:
        return a is b
    if isinstance(a, standin.StrictBaseModel):  # a config default: the fields the stand-in has
        theirs = b.model_dump() if hasattr(b, "model_dump") else {}
        return type(a).__name__ == type(b).__name__ and all(theirs.get(k, MISSING) == v for k, v in a.model_dump().items())
    return a == b


def differences(ours: types.ModuleType, real: types.ModuleType, llmapi: types.ModuleType, llm_args) -> list[str]:
    """What the stand-in `ours` declares that the real package (`real`, its `llmapi` and its
    `llmapi.llm_args`) does not have, or has with another default."""
    problems = []
    for name in CONFIGS:
        cls = getattr(llmapi, name, None)
        if cls is None:
            problems.append(f"tensorrt_llm.llmapi has no {name}")
            continue
        problems += compare(name, pydantic_defaults(getattr(ours, name)), pydantic_defaults(cls))
        if cls.model_config.get("extra") != "forbid":
            problems.append(f"{name} does not forbid unknown fields upstream")
    problems += compare("TorchLlmArgs", pydantic_defaults(ours.TorchLlmArgs), pydantic_defaults(llm_args.TorchLlmArgs))
    problems += compare("SamplingParams", dataclass_defaults(ours.SamplingParams), dataclass_defaults(real.SamplingParams))
    for method in ("__init__", "generate_async"):
        problems += compare(f"LLM.{method}", signature_defaults(getattr(ours.LLM, method)),
                            signature_defaults(getattr(real.LLM, method)))
    if inspect.iscoroutinefunction(real.LLM.get_stats_async):
        problems.append("LLM.get_stats_async is a coroutine function upstream (a plain method here)")
    if not hasattr(llmapi, "RequestError"):
        problems.append("tensorrt_llm.llmapi has no RequestError")
    return problems


def test_the_stand_in_declares_what_the_real_tensorrt_llm_declares():
    try:
        real = importlib.import_module("tensorrt_llm")
        llmapi = importlib.import_module("tensorrt_llm.llmapi")
        llm_args = importlib.import_module("tensorrt_llm.llmapi.llm_args")
    except ImportError as exc:
        required("KVGATE_REQUIRE_TRTLLM", f"tensorrt_llm does not import here ({exc}): it needs NVIDIA GPUs; "
                                          "bench/gpu_check.py runs this contract where it does")
    assert differences(standin, real, llmapi, llm_args) == []


def test_the_comparison_catches_a_changed_default_a_missing_field_and_a_missing_keyword():
    """The positive control: the stand-in compared with itself passes, and with a copy that
    differs in one default, one field and one keyword, each difference is named."""
    itself = differences(standin, standin, standin, standin)
    assert itself == []

    class KvCacheConfig(standin.StrictBaseModel):  # upstream changed a default, dropped a field
        enable_block_reuse: bool = True
        max_tokens: int | None = None
        free_gpu_memory_fraction: float | None = 0.85
        dtype: str = "auto"

    class LLM(standin.LLM):
        def generate_async(self, inputs, sampling_params=None, streaming=False):  # fewer keywords
            return super().generate_async(inputs, sampling_params, streaming=streaming)

    changed = types.SimpleNamespace(**{**vars(standin), "KvCacheConfig": KvCacheConfig, "LLM": LLM})
    assert sorted(differences(standin, changed, changed, changed)) == sorted([
        "KvCacheConfig.free_gpu_memory_fraction: default 0.9 here, 0.85 upstream",
        "KvCacheConfig: no 'tokens_per_block' upstream",
        *[f"LLM.generate_async: no {k!r} upstream" for k in standin.LLM.GENERATE_ASYNC
          if k not in ("inputs", "sampling_params", "streaming")],
    ])
