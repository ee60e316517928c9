"""Per-request sampling settings as the engine sees them (plain data, no torch)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int | None = None  # None: until the model's context is full
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 disables top-k
    min_p: float = 0.0
    seed: int | None = None  # per-request generator: same seed, same tokens, whatever the batch
    stop: tuple[str, ...] = ()  # stop strings (handled on text by the output processor)
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # None: off; k >= 0: the sampled token's logprob plus top k

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
