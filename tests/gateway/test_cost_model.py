"""gateway/routing/cost_model.py: precise_prefix's expected time to first token per deployment
(issue 44 item 1). Expected values are worked by hand in each test from the documented formula
(docs/guide/routing.md):

    estimate = (queued_tokens + unmatched_tokens) / token_rate + decoding x step_s
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from gateway.backend import LoadSnapshot
from gateway.routing.cost_model import CostModel


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def engine(name, running=0, waiting=0, in_flight=0, **counters):
    """A deployment whose backend reports `counters` as the native engine does (LoadSnapshot.extra)."""
    snapshot = LoadSnapshot(waiting=waiting, running=running, extra=dict(counters))
    return SimpleNamespace(name=name, in_flight=in_flight, backend=SimpleNamespace(load=lambda: snapshot))


def test_without_exported_rates_the_options_price_the_prompt():
    model = CostModel(tokens_per_s=500, step_s=0.04, clock=Clock())
    # 300 tokens to prefill at 500/s = 0.6 s, 3 running x 0.04 s = 0.12 s
    assert model.estimate(engine("a", running=3), 300) == pytest.approx(0.72)
    # 2 running, one of them still in the gateway's queue (priced as its 100 queued tokens, not twice):
    # (100 + 50) / 500 = 0.3 s, 1 decoding x 0.04 s
    b = engine("b", running=2)
    model.estimate(b, 0)
    model.routed(b, 100)
    assert model.estimate(b, 50) == pytest.approx(0.34)


def test_measured_rates_come_from_the_engines_step_counters():
    model = CostModel(tokens_per_s=500, step_s=0.04, clock=Clock())
    counters = {"num_step_tokens": 1000.0, "step_seconds": 2.0, "num_steps": 50.0}
    d = engine("a", **counters)
    model.rates(d)  # the first look: a baseline, nothing measured yet
    counters.update(num_step_tokens=5000.0, step_seconds=4.0, num_steps=150.0)
    d = engine("a", running=2, **counters)
    # since the last look 4000 tokens in 2 s of steps: 2000 tokens/s; 2 s over 100 steps: 0.02 s a step
    assert model.rates(d) == pytest.approx((2000.0, 0.02))
    # 400 tokens at 2000/s = 0.2 s, 2 running x 0.02 = 0.04 s
    assert model.estimate(d, 400) == pytest.approx(0.24)
    counters.update(num_step_tokens=6000.0, step_seconds=5.0, num_steps=200.0)
    # next: 1000 tokens in 1 s = 1000/s, smoothed 0.7 x 2000 + 0.3 x 1000 = 1700; step 0.7 x 0.02 + 0.3 x 0.02
    assert model.rates(engine("a", **counters)) == pytest.approx((1700.0, 0.02))
    counters.update(num_step_tokens=10.0, step_seconds=0.1, num_steps=3.0)  # the engine restarted
    assert model.rates(engine("a", **counters)) == pytest.approx((1700.0, 0.02))  # kept until measured again


def test_an_engine_not_measured_yet_is_priced_as_its_measured_peers():
    """An idle engine exports no change in its counters: the median of the measured ones prices
    it, not the option (2000 tokens/s here against a measured 300 would make it look 6x faster)."""
    model = CostModel(tokens_per_s=2000, step_s=0.5, clock=Clock())
    for name, (tokens, seconds) in {"a": (600, 2.0), "b": (1000, 4.0), "c": (1050, 3.0)}.items():
        model.rates(engine(name, num_step_tokens=0.0, step_seconds=0.0, num_steps=0.0))
        model.rates(engine(name, num_step_tokens=float(tokens), step_seconds=seconds, num_steps=10.0))
    # measured 300, 250 and 350 tokens/s, steps 0.2, 0.4, 0.3 s: medians 300 and 0.3
    idle = engine("idle", num_step_tokens=0.0, step_seconds=0.0, num_steps=0.0)
    assert model.rates(idle) == pytest.approx((300.0, 0.3))
    # 600 unmatched tokens at 300/s = 2 s (at the option's 2000/s it would have been 0.3 s)
    assert model.estimate(idle, 600) == pytest.approx(2.0)


def test_the_work_it_routed_queues_and_drains_at_the_engines_rate():
    clock = Clock()
    model = CostModel(tokens_per_s=1000, step_s=0.0, clock=clock)
    a, b = engine("a"), engine("b")
    model.estimate(a, 0)
    model.routed(a, 800)  # a was sent 800 tokens to prefill at t=0
    clock.now = 0.25  # a worked off 250 of them
    # a: (550 queued + 100) / 1000 = 0.65 s; b, empty: (0 + 600) / 1000 = 0.6 s
    assert model.estimate(a, 100) == pytest.approx(0.65)
    assert model.estimate(b, 600) == pytest.approx(0.6)
    clock.now = 2.0  # drained, not below 0
    assert model.estimate(a, 100) == pytest.approx(0.1)
    model.routed(a, 300)
    model.routed(a, 200)
    clock.now = 2.4  # 400 tokens worked off: the first request's 300, then 100 of the second's
    assert model.queued_tokens(a, 1000) == (pytest.approx(100.0), 1)


def test_bad_rates_are_refused():
    with pytest.raises(ValueError, match="tokens_per_s"):
        CostModel(tokens_per_s=0, step_s=0.01)


def test_engines_that_share_compute_share_one_queue():
    """shared_compute: each engine's queue is everyone's. a was sent 600 tokens, b nothing, at
    1000 tokens/s, no time passed. A prompt a holds 500 of 700 tokens of, b 0:
        apart:  a (600 + 200) / 1000 = 0.8 s,  b (0 + 700) / 1000 = 0.7 s   -> b
        shared: a (600 + 0 + 200) / 1000 = 0.8 s,  b (0 + 600 + 700) / 1000 = 1.3 s   -> a"""
    model = CostModel(tokens_per_s=1000, step_s=0.0, clock=Clock())
    a, b = engine("a"), engine("b")
    model.estimate(a, 0)
    model.routed(a, 600)
    unmatched = {"a": 200, "b": 700}
    assert model.estimates([a, b], unmatched) == pytest.approx({"a": 0.8, "b": 0.7})
    assert model.estimates([a, b], unmatched, shared_compute=True) == pytest.approx({"a": 0.8, "b": 1.3})
