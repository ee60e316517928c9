"""Greedy answers of one loaded model through a fresh KV cache of each dtype: the engine's model
runner (prefill, then one decode step a token, the C fused step where it applies) and its fp8
calibration, without building an engine per KV dtype (one model load per weight format)."""

from __future__ import annotations

import math

import torch

from native_backend.core.batch import ScheduledChunk, SchedulerOutput
from native_backend.core.sampling_params import SamplingParams
from native_backend.execution import kv_scales
from native_backend.execution.model_runner import ModelRunner
from native_backend.model.kv_cache import KVCache, resolve_kv_dtype

BLOCK = 16
GREEDY = SamplingParams(temperature=0.0)


def cache_for(model, kv_dtype: str, tokenizer, num_tokens: int, center_keys: bool = True) -> KVCache:
    """A cache of `kv_dtype` for `num_tokens`, with the engine's fp8 calibration (kv_scales)."""
    dtype = resolve_kv_dtype(kv_dtype)
    cache = KVCache.for_model(model.config, num_blocks=math.ceil(num_tokens / BLOCK) + 1, block_size=BLOCK,
                              dtype=dtype)
    if dtype.scaling == "per_layer":
        found = kv_scales.calibrate(model, kv_scales.calibration_ids(tokenizer), dtype, torch.device("cpu"),
                                    center_keys)
        kv_scales.apply(cache, found.scales, found.k_offsets)
    return cache


def greedy_answer(model, cache: KVCache, prompt: list[int], max_tokens: int, eos: set[int]) -> list[int]:
    """The greedy continuation of `prompt` (up to max_tokens, stopping at an EOS id)."""
    runner, blocks = ModelRunner(model, cache), list(range(1, cache.num_blocks))
    out: list[int] = []
    chunk = ScheduledChunk("a", list(prompt), 0, blocks, True, GREEDY)
    while True:
        token = runner.execute(SchedulerOutput([chunk])).sampled_token_ids["a"][0]
        out.append(token)
        if token in eos or len(out) == max_tokens:
            return out
        chunk = ScheduledChunk("a", [token], len(prompt) + len(out) - 1, blocks, True, GREEDY,
                               prompt_token_ids=list(prompt), output_token_ids=list(out))
