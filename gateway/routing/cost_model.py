"""`precise_prefix`'s cost model: the expected time to first token of a prompt on each deployment.

    estimate(d) = (queued_tokens(d) + unmatched_tokens(d)) / token_rate(d) + decoding(d) x step_s(d)

- unmatched_tokens(d): the prompt's tokens d does not hold (prompt - its cached prefix, from the KV
  index: confirmed blocks and the gateway's provisional ones), which d must prefill;
- queued_tokens(d): prefill work the gateway sent d and d has not worked off yet: each routed
  request adds its unmatched tokens, and the sum drains at token_rate(d) per second of wall time
  (a leaky bucket: it needs no word from the engine, which reports its queue late);
- token_rate(d): tokens d computes per second of step time, measured from what the engine
  exports (the native engine's num_step_tokens and step_seconds counters: the change between two
  looks, smoothed); one not measured yet takes the median of its measured peers', else the
  `tokens_per_s` option;
- decoding(d) x step_s(d): each sequence d runs past its prefill adds its decodes to the steps the
  prompt's prefill shares, about one step's time each (step_s: the engine's step_seconds /
  num_steps, measured the same way, else the `step_s` option). decoding(d) is the engine's running
  count less the requests still in the gateway's queue for it: those are priced as queued prefill
  already, not twice.

The least estimate wins. Matched tokens are worth what they save on that engine, queued work costs
what it delays: a conversation stays where its turns are cached until its engine's queue costs
more than the prefill it saves, and a prompt every engine holds equally goes to the least queued.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
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
        # deployment -> (each routed request's prefill tokens not worked off yet, oldest first; when)
        self._queued: dict[str, tuple[deque, float]] = {}

    def rates(self, d, load=None) -> tuple[float, float]:
        """(token_rate, step_s) of `d`: measured where its engine exports the counters."""
        extra = (load or d.backend.load()).extra
        rates = self._rates.setdefault(d.name, _Rates())
        if "num_step_tokens" in extra and "step_seconds" in extra:
            _measure(rates, extra["num_step_tokens"], extra["step_seconds"], extra.get("num_steps", 0.0))
        if rates.token_rate is None:  # not measured yet (idle so far): priced as its measured peers
            return self._peers()
        return rates.token_rate, rates.step_s if rates.step_s is not None else self.step_s

    def _peers(self) -> tuple[float, float]:
        """The median measured rates of the other deployments, else the options: an engine of the
        pool that has not run yet is no faster than its peers (a default far from the truth made
        idle engines look several times faster than the busy one that was measured)."""
        measured = [r for r in self._rates.values() if r.token_rate is not None]
        if not measured:
            return self.tokens_per_s, self.step_s
        steps = [r.step_s for r in measured if r.step_s is not None]
        return (statistics.median(r.token_rate for r in measured),
                statistics.median(steps) if steps else self.step_s)

    def queued_tokens(self, d, token_rate: float) -> tuple[float, int]:
        """(tokens, requests) the gateway sent `d` to prefill and it has not worked off by now,
        at `token_rate`, oldest first."""
        queue, since = self._queued.get(d.name, (None, 0.0))
        now = self._clock()
        if queue is None:
            queue = deque()
        done = (now - since) * token_rate
        while queue and queue[0] <= done:
            done -= queue.popleft()
        if queue:
            queue[0] -= done
        self._queued[d.name] = (queue, now)
        return sum(queue), len(queue)

    def estimate(self, d, unmatched_tokens: int, others_queued: float = 0.0) -> float:
        """Expected seconds to the first token of a prompt with `unmatched_tokens` to prefill on `d`
        (`others_queued`: tokens queued on engines that share d's compute, see `estimates`)."""
        load = d.backend.load()
        token_rate, step_s = self.rates(d, load)
        queued, requests = self.queued_tokens(d, token_rate)
        decoding = max(0, load.running - requests)
        return (queued + others_queued + unmatched_tokens) / token_rate + decoding * step_s

    def estimates(self, candidates, unmatched: dict[str, int], shared_compute: bool = False) -> dict[str, float]:
        """`estimate` of each candidate. With `shared_compute` (engines on one host's cores, or one
        device, that take their compute from each other) every candidate's queue is the sum of all
        of theirs: moving a prompt to an idle engine then buys no compute, and what separates the
        engines is the prefill each saves."""
        others = dict.fromkeys((d.name for d in candidates), 0.0)
        if shared_compute:
            queued = {d.name: self.queued_tokens(d, self.rates(d)[0])[0] for d in candidates}
            total = sum(queued.values())
            others = {name: total - q for name, q in queued.items()}
        return {d.name: self.estimate(d, unmatched[d.name], others[d.name]) for d in candidates}

    def routed(self, d, unmatched_tokens: int) -> None:
        """`d` was given a prompt with `unmatched_tokens` to prefill: its queue grows by them."""
        queue, since = self._queued.get(d.name, (None, self._clock()))
        queue = queue if queue is not None else deque()
        if unmatched_tokens > 0:
            queue.append(float(unmatched_tokens))
        self._queued[d.name] = (queue, since)

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
