"""Per-layer K and V scales of an fp8 KV cache: from the checkpoint when it has them, else from a
calibration pass at start; 1.0 only when asked.

    stored = fp8(x / scale):  scale = max|x| seen in calibration x HEADROOM / fp8's largest value

Calibration runs the model once over CALIBRATION_TOKENS tokens of built-in text into a temporary
float cache and reads max|K| and max|V| of each layer back from it (what vLLM's
`calculate_kv_scales` measures), and each layer's mean key: a calibrated cache stores keys minus
that mean (KVLayer.k_offset; `calibrate` says why), its K scale covering max|K - mean|. The text is a few short conversations through the model's chat
template (its special tokens and role headers are what served prompts start with; on SmolLM2 one
chat prompt's |V| reaches 1.48x the largest the docstrings alone produce in a layer), then the
docstrings of a few standard-library modules. Neither is what accuracy is evaluated on
(`pydoc_data.topics`, and bench/kv_quant.py's battery of chat prompts).
"""

from __future__ import annotations

import importlib
import logging
import math
from dataclasses import dataclass

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


@dataclass(frozen=True)
class Calibration:
    scales: list[tuple[float, float]]  # (k_scale, v_scale) per layer
    k_offsets: torch.Tensor | None  # (layers, kv_heads, head_dim) float32: the keys' mean; None: not centered


def calibrate(model, token_ids: list[int], kv_dtype: KVCacheDType, device: torch.device,
              center_keys: bool = True, link=None) -> Calibration:
    """Per layer, the keys' mean (`center_keys`) and the K and V scales that cover the centered
    keys and the values, from one pass of the model over `token_ids`.

    Keys carry a large constant part per channel (RMS 2.3 in SmolLM2's middle layers, 1.4 without
    it); fp8's error is relative to each value, so storing k - mean (KVLayer.k_offset) shrinks the
    keys' error by that ratio, and softmax cannot see the shift."""
    num_blocks = math.ceil(len(token_ids) / CALIBRATION_BLOCK) + 1
    config = model.config  # this rank's KV heads (a tensor-parallel rank holds a share of them)
    scratch = KVCache(num_layers=len(model.attention_layers()), num_blocks=num_blocks, block_size=CALIBRATION_BLOCK,
                      num_kv_heads=model.attention_layers()[0].num_kv_heads, head_dim=config.head_dim,
                      dtype="float32", device=device)
    runner = ModelRunner(model, scratch, device, link=link)  # a pipeline stage: the pass runs through every stage
    chunk = ScheduledChunk("kv-scale-calibration", list(token_ids), 0, list(range(1, num_blocks)), True,
                           SamplingParams(temperature=0.0))
    runner.compute_logits(SchedulerOutput([chunk]))
    rows = slice(CALIBRATION_BLOCK, CALIBRATION_BLOCK + len(token_ids))  # the chunk's slots: blocks 1.. in order
    keys = [layer.key.flatten(0, 1)[rows] for layer in scratch.layers]  # (tokens, kv_heads, head_dim) each
    values = [layer.value.flatten(0, 1)[rows] for layer in scratch.layers]
    offsets = torch.stack([k.mean(dim=0) for k in keys]) if center_keys else None  # (layers, kv_heads, head_dim)
    centered = keys if offsets is None else [k - c for k, c in zip(keys, offsets)]
    return Calibration([(_scale(k, kv_dtype), _scale(v, kv_dtype)) for k, v in zip(centered, values)], offsets)


def _scale(x: torch.Tensor, kv_dtype: KVCacheDType) -> float:
    amax = float(x.abs().max())
    return max(amax, 1e-6) * HEADROOM / kv_dtype.max_value


def apply(cache: KVCache, scales: list[tuple[float, float]], k_offsets: torch.Tensor | None = None) -> None:
    """Per-layer scales, and the keys' offsets (calibrated with them) onto the cache's layers."""
    for i, (layer, (k_scale, v_scale)) in enumerate(zip(cache.layers, scales, strict=True)):
        layer.k_scale, layer.v_scale = k_scale, v_scale
        if k_offsets is not None:
            layer.k_offset = k_offsets[i].to(device=layer.key.device, dtype=torch.float32).contiguous()


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
