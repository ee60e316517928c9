"""`precise_prefix`'s cost model: the expected time to first token of a prompt on each deployment.

    estimate(d) = (queued_tokens(d) + unmatched_tokens(d)) / token_rate(d) + running(d) x step_s(d)

- unmatched_tokens(d): the prompt's tokens d does not hold (prompt - its cached prefix, from the KV
  index: confirmed blocks and the gateway's provisional ones), which d must prefill;
- queued_tokens(d): prefill work the gateway sent d and d has not worked off yet: each routed
  request adds its unmatched tokens, and the sum drains at token_rate(d) per second of wall time
  (a leaky bucket: it needs no word from the engine, which reports its queue late);
- token_rate(d): tokens d computes per second of step time, measured from what the engine
  exports (the native engine's num_step_tokens and step_seconds counters: the change between two
  looks, smoothed), else the `tokens_per_s` option;
- running(d) x step_s(d): each sequence d is running adds its decodes to the steps the prompt's
  prefill shares, about one step's time each (step_s: the engine's step_seconds / num_steps,
  measured the same way, else the `step_s` option); running as load_score counts it.

The least estimate wins. Matched tokens are worth what they save on that engine, queued work costs
what it delays: a conversation stays where its turns are cached until its engine's queue costs
more than the prefill it saves, and a prompt every engine holds equally goes to the least queued.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

SMOOTHING = 0.3  # weight of the newest measured rate (exponential moving average)
MIN_STEP_TOKENS = 64  # a rate measured over fewer tokens than this is noise: not taken


@dataclass
class _Rates:
    tokens: float = 0.0  # the engine's counters at the last look
    seconds: float = 0.0
    steps: float = 0.0
    seen: bool = False  # the counters were read once: the next look measures from them
    token_rate: float | None = None  # measured, smoothed
    step_s: float | None = None


class CostModel:
    def __init__(self, tokens_per_s: float, step_s: float, clock=time.monotonic):
        if tokens_per_s <= 0 or step_s < 0:
            raise ValueError("precise_prefix: tokens_per_s must be > 0 and step_s >= 0")
        self.tokens_per_s, self.step_s = tokens_per_s, step_s
        self._clock = clock
        self._rates: dict[str, _Rates] = {}
        self._queued: dict[str, tuple[float, float]] = {}  # deployment -> (tokens, when)

    def rates(self, d, load=None) -> tuple[float, float]:
        """(token_rate, step_s) of `d`: measured where its engine exports the counters."""
        extra = (load or d.backend.load()).extra
        rates = self._rates.setdefault(d.name, _Rates())
        if "num_step_tokens" in extra and "step_seconds" in extra:
            _measure(rates, extra["num_step_tokens"], extra["step_seconds"], extra.get("num_steps", 0.0))
        return rates.token_rate or self.tokens_per_s, rates.step_s if rates.step_s is not None else self.step_s

    def queued_tokens(self, d, token_rate: float) -> float:
        tokens, since = self._queued.get(d.name, (0.0, 0.0))
        now = self._clock()
        left = max(0.0, tokens - (now - since) * token_rate)
        self._queued[d.name] = (left, now)
        return left

    def estimate(self, d, unmatched_tokens: int) -> float:
        """Expected seconds to the first token of a prompt with `unmatched_tokens` to prefill on `d`."""
        load = d.backend.load()
        token_rate, step_s = self.rates(d, load)
        running = max(load.running, d.in_flight - load.waiting)
        return (self.queued_tokens(d, token_rate) + unmatched_tokens) / token_rate + running * step_s

    def routed(self, d, unmatched_tokens: int) -> None:
        """`d` was given a prompt with `unmatched_tokens` to prefill: its queue grows by them."""
        tokens, since = self._queued.get(d.name, (0.0, self._clock()))
        self._queued[d.name] = (tokens + unmatched_tokens, since)

    def forget(self, keep) -> None:
        """Drop what is known of deployments not in `keep` (names)."""
        for table in (self._rates, self._queued):
            for name in [n for n in table if n not in keep]:
                del table[name]


def _measure(rates: _Rates, tokens: float, seconds: float, steps: float) -> None:
    """Take the change since the last look as a new measurement (a counter that went back: the
    engine restarted, start over from its new values)."""
    d_tokens, d_seconds, d_steps = tokens - rates.tokens, seconds - rates.seconds, steps - rates.steps
    if not rates.seen or d_tokens < 0 or d_seconds < 0 or d_steps < 0:
        rates.tokens, rates.seconds, rates.steps, rates.seen = tokens, seconds, steps, True
        return
    if d_tokens < MIN_STEP_TOKENS or d_seconds <= 0:
        return  # too little since the last look: wait for more
    rates.token_rate = _smooth(rates.token_rate, d_tokens / d_seconds)
    if d_steps > 0:
        rates.step_s = _smooth(rates.step_s, d_seconds / d_steps)
    rates.tokens, rates.seconds, rates.steps = tokens, seconds, steps


def _smooth(old: float | None, new: float) -> float:
    return new if old is None else (1 - SMOOTHING) * old + SMOOTHING * new
