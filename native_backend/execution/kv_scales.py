"""Per-layer K and V scales of an fp8 KV cache: from the checkpoint when it has them, else from a
calibration pass at start; 1.0 only when asked.

    stored = fp8(x / scale):  scale = max|x| seen in calibration x HEADROOM / fp8's largest value

Calibration runs the model once over CALIBRATION_TOKENS tokens of built-in text into a temporary
float cache and reads max|K| and max|V| of each layer back from it (what vLLM's
`calculate_kv_scales` measures). The text is a few short conversations through the model's chat
template (its special tokens and role headers are what served prompts start with; on SmolLM2 one
chat prompt's |V| reaches 1.48x the largest the docstrings alone produce in a layer), then the
docstrings of a few standard-library modules. Neither is what accuracy is evaluated on
(`pydoc_data.topics`, and bench/kv_quant.py's battery of chat prompts).
"""

from __future__ import annotations

import importlib
import logging
import math

import torch

from native_backend.core.batch import ScheduledChunk, SchedulerOutput
from native_backend.core.sampling_params import SamplingParams
from native_backend.execution.model_runner import ModelRunner
from native_backend.model.kv_cache import KVCache, KVCacheDType

log = logging.getLogger("kvgate.engine")

# Conversations (user, assistant) for the chat template's part: none of the evaluation's prompts.
CALIBRATION_CHATS = (
    ("Can you explain how a bicycle gear works?",
     "A bicycle gear changes how far the wheel turns for each turn of the pedals. A larger rear cog makes "
     "pedalling easier but slower; a smaller one makes it harder but faster."),
    ("Écris une phrase sur la pluie.", "La pluie tombe doucement sur les toits de la ville endormie."),
    ("Sort these numbers: 42, 7, 19, 3.", "Sorted in ascending order: 3, 7, 19, 42."),
    ("Write a JSON object with a name and an age.", '{"name": "Ada", "age": 36}'),
    ("What should I pack for a weekend hike?",
     "Water, snacks, a rain jacket, a map, sunscreen, a first-aid kit and sturdy shoes."),
)
CALIBRATION_MODULES = ("argparse", "json", "collections", "functools", "typing", "pathlib", "logging", "asyncio")
CALIBRATION_TOKENS = 512
# Later tokens may reach beyond what calibration saw; twice the observed range keeps them
# unclipped and costs fp8 only the bottom of its exponent range (vLLM's default K/V scale
# constants leave a similar margin).
HEADROOM = 2.0
CALIBRATION_BLOCK = 16


def calibration_text() -> str:
    docs = [importlib.import_module(name).__doc__ or "" for name in CALIBRATION_MODULES]
    return "\n\n".join(d.strip() for d in docs if d.strip())


def calibration_ids(tokenizer, limit: int = CALIBRATION_TOKENS) -> list[int]:
    """The calibration tokens: the conversations through the chat template (when the model has
    one), then the docstrings, `limit` tokens in all."""
    ids: list[int] = []
    if tokenizer.chat_template:
        for user, assistant in CALIBRATION_CHATS:
            ids += tokenizer.apply_chat_template([{"role": "user", "content": user},
                                                  {"role": "assistant", "content": assistant}],
                                                 add_generation_prompt=False)
    return (ids + tokenizer.encode(calibration_text()))[:limit]


def calibrate(model, token_ids: list[int], kv_dtype: KVCacheDType, device: torch.device) -> list[tuple[float, float]]:
    """(k_scale, v_scale) per layer from one pass of the model over `token_ids`."""
    num_blocks = math.ceil(len(token_ids) / CALIBRATION_BLOCK) + 1
    config = model.config  # this rank's KV heads (a tensor-parallel rank holds a share of them)
    scratch = KVCache(num_layers=config.num_layers, num_blocks=num_blocks, block_size=CALIBRATION_BLOCK,
                      num_kv_heads=model.attention_layers()[0].num_kv_heads, head_dim=config.head_dim,
                      dtype="float32", device=device)
    runner = ModelRunner(model, scratch, device)
    chunk = ScheduledChunk("kv-scale-calibration", list(token_ids), 0, list(range(1, num_blocks)), True,
                           SamplingParams(temperature=0.0))
    runner.compute_logits(SchedulerOutput([chunk]))
    return [(_scale(layer.key, kv_dtype), _scale(layer.value, kv_dtype)) for layer in scratch.layers]


def _scale(cache: torch.Tensor, kv_dtype: KVCacheDType) -> float:
    amax = float(cache.abs().max())
    return max(amax, 1e-6) * HEADROOM / kv_dtype.max_value


def apply(cache: KVCache, scales: list[tuple[float, float]]) -> None:
    for layer, (k_scale, v_scale) in zip(cache.layers, scales, strict=True):
        layer.k_scale, layer.v_scale = k_scale, v_scale


def clamp_report(cache: KVCache) -> list[tuple[list[int], list[int]]]:
    """Per layer, (K, V) counts per KV head of values clamped at the format's range since the cache
    was made (fp8); empty for formats that do not clamp."""
    return [(layer.clamped[0].tolist(), layer.clamped[1].tolist()) for layer in cache.layers
            if layer.clamped is not None]


def clamped_totals(cache: KVCache) -> tuple[int, int]:
    """(K, V) values clamped at the format's range since the cache was made, every layer and head."""
    counts = [layer.clamped for layer in cache.layers if layer.clamped is not None]
    if not counts:
        return 0, 0
    total = torch.stack(counts).sum(dim=(0, 2)).tolist()
    return int(total[0]), int(total[1])


def describe(scales: list[tuple[float, float]]) -> str:
    ks, vs = [k for k, _ in scales], [v for _, v in scales]
    return f"K scales {min(ks):.3g}..{max(ks):.3g}, V scales {min(vs):.3g}..{max(vs):.3g}"
