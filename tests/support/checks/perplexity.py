"""How well a model predicts held-out text, for the quantization tests: each window of tokens
runs as one prefill through the engine's model runner, every position's logits kept
(teacher-forced: the model always sees the true text, so one early miss does not decide the
rest, as it does in a greedy comparison)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pydoc_data.topics
import torch
import torch.nn.functional as F

from native_backend.core.batch import ScheduledChunk, SchedulerOutput
from native_backend.core.sampling_params import SamplingParams
from native_backend.execution.model_runner import ModelRunner
from native_backend.model.kv_cache import KVCache

BLOCK = 16


def held_out_windows(tokenizer, count: int, length: int, skip_topics: int = 70) -> list[list[int]]:
    """`count` windows of `length` tokens of `pydoc_data.topics` (never calibration text: the
    calibration set shares no paragraph with it, tests/native_backend/test_awq_search.py)."""
    text = "\n\n".join(list(pydoc_data.topics.topics.values())[skip_topics:])
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) >= count * length, "not enough held-out text"
    return [ids[i * length:(i + 1) * length] for i in range(count)]


@dataclass
class Scores:
    nll: float  # summed over every predicted token
    tokens: int
    argmax: torch.Tensor  # (tokens,) the model's top-1 at each predicted position

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll / self.tokens)

    def top1_agreement(self, other: "Scores") -> float:
        return float((self.argmax == other.argmax).float().mean())


def score(model, windows: list[list[int]]) -> Scores:
    length = max(map(len, windows))
    runner = ModelRunner(model, KVCache.for_model(model.config, num_blocks=length // BLOCK + 1, block_size=BLOCK))
    nll, argmax = 0.0, []
    for window in windows:
        chunk = ScheduledChunk("w", list(window), 0, list(range(len(window) // BLOCK + 1)), True,
                               SamplingParams(temperature=0.0))
        logits = runner.compute_logits(SchedulerOutput([chunk]), all_tokens=True)["w"][:-1].float()  # (len - 1, vocab)
        nll += float(F.cross_entropy(logits, torch.tensor(window[1:]), reduction="sum"))
        argmax.append(logits.argmax(-1))
    return Scores(nll, sum(len(w) - 1 for w in windows), torch.cat(argmax))
