"""Per-request sampling settings as the engine sees them (plain data, no torch)."""

from __future__ import annotations

import math
from dataclasses import dataclass

# torch.Generator.manual_seed takes [-2**63, 2**64); the API gives seeds in [0, 2**63).
SEED_RANGE = (-(2**63), 2**64 - 1)
MAX_STOP_TOKEN_IDS = 1024  # a stop-token set is checked per sampled token: keep it small
MAX_STOP_CHARS = 4096  # total length of the stop strings (each token's text is matched against them)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int | None = None  # None: until the model's context is full
    # max_tokens is a server's bound, not the client's number: lowered to what the context and
    # the cache leave for the prompt (vLLM's default) instead of refused as too long.
    max_tokens_default: bool = False
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

    def check(self, vocab_size: int) -> None:
        """Raise ValueError naming the field when a value would make a batched sampling step
        fail (or turn to NaN) for every request in it. The engine calls it on arrival."""
        for name, problem in _problems(self, vocab_size):
            raise ValueError(f"{name}: {problem}")


def _problems(p: SamplingParams, vocab_size: int):
    if p.max_tokens is not None and not (_is_int(p.max_tokens) and p.max_tokens >= 1):
        yield "max_tokens", f"must be a positive integer, got {p.max_tokens!r}"
    for name, low, high in (("temperature", 0.0, 100.0), ("top_p", 0.0, 1.0), ("min_p", 0.0, 1.0),
                            ("presence_penalty", -100.0, 100.0), ("frequency_penalty", -100.0, 100.0),
                            ("repetition_penalty", 1e-3, 100.0)):
        value = getattr(p, name)
        if not (_is_number(value) and low <= value <= high) or (name == "top_p" and value == 0.0):
            yield name, f"must be a number in {'(' if name == 'top_p' else '['}{low:g}, {high:g}], got {value!r}"
    if not (_is_int(p.top_k) and 0 <= p.top_k <= 2**31 - 1):
        yield "top_k", f"must be an integer in [0, 2**31), got {p.top_k!r}"
    if p.seed is not None and not (_is_int(p.seed) and SEED_RANGE[0] <= p.seed <= SEED_RANGE[1]):
        yield "seed", f"must be an integer in [-2**63, 2**64), got {p.seed!r}"
    if p.logprobs is not None and not (_is_int(p.logprobs) and 0 <= p.logprobs <= vocab_size):
        yield "logprobs", f"must be an integer in [0, {vocab_size}], got {p.logprobs!r}"
    if len(p.stop_token_ids) > MAX_STOP_TOKEN_IDS or not all(_is_int(t) for t in p.stop_token_ids):
        yield "stop_token_ids", f"must be at most {MAX_STOP_TOKEN_IDS} integers"
    if not all(isinstance(s, str) for s in p.stop) or sum(map(len, p.stop)) > MAX_STOP_CHARS:
        yield "stop", f"must be strings of at most {MAX_STOP_CHARS} characters in all"


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
