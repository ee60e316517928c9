"""Routing policies choose among real echo backends by weight, load and prompt prefix."""

import asyncio
from collections import Counter

import pytest

from gateway.backend import GenerationRequest, SamplingParams
from gateway.pools.breaker import CircuitBreaker
from gateway.pools.registry import Deployment
from gateway.routing.policies import LeastLoaded, PowerOfTwo, PrefixAffinity, RoundRobin, WeightedRandom, load_score
from kvgate_echo import EchoBackend, EchoSettings


def deployment(name, weight=1.0, capacity=0):
    backend = EchoBackend(EchoSettings(max_concurrency=capacity), name=name)
    return Deployment(name, "m", "m", weight, backend, CircuitBreaker(3, 1.0), started=True)


def request(prompt="hello world"):
    return GenerationRequest(request_id="r", model="m", sampling=SamplingParams(), prompt=prompt)


def test_round_robin_takes_turns():
    ds = [deployment(n) for n in "abc"]
    policy = RoundRobin({})
    assert [policy.choose(request(), ds).name for _ in range(6)] == list("abcabc")


def test_weighted_random_follows_weights():
    ds = [deployment("light", 1), deployment("heavy", 3)]
    policy = WeightedRandom({"seed": 7})
    counts = Counter(policy.choose(request(), ds).name for _ in range(4000))
    assert 0.7 < counts["heavy"] / 4000 < 0.8


def test_least_loaded_prefers_fewer_in_flight_and_spreads_ties():
    a, b, c = deployment("a"), deployment("b"), deployment("c")
    a.in_flight, b.in_flight, c.in_flight = 3, 1, 1
    policy = LeastLoaded({})
    picks = Counter(policy.choose(request(), [a, b, c]).name for _ in range(10))
    assert picks["a"] == 0 and picks["b"] == 5 and picks["c"] == 5


def test_least_loaded_reads_the_backends_own_running_count():
    busy, idle = deployment("busy", capacity=4), deployment("idle", capacity=4)

    async def occupy():
        gen = busy.backend.generate(GenerationRequest("x", "m", SamplingParams(max_tokens=3), prompt="a b"))
        await anext(gen)
        assert busy.backend.load().running == 1
        assert load_score(busy) > load_score(idle)
        assert LeastLoaded({}).choose(request(), [busy, idle]) is idle
        await gen.aclose()

    asyncio.run(occupy())


def test_power_of_two_never_picks_the_most_loaded_of_many():
    ds = [deployment(str(i)) for i in range(5)]
    ds[0].in_flight = 100
    policy = PowerOfTwo({"seed": 1})
    picks = Counter(policy.choose(request(), ds).name for _ in range(500))
    assert picks["0"] == 0
    assert len(picks) == 4


def test_prefix_affinity_sends_a_prefix_home_until_it_is_overloaded():
    ds = [deployment(n) for n in "abcd"]
    policy = PrefixAffinity({"prefix_chars": 32, "max_score": 2})
    shared = "You are a helpful assistant. " * 3
    homes = {policy.choose(request(shared + f"question {i}"), ds).name for i in range(20)}
    assert len(homes) == 1  # same first 32 characters, same deployment
    spread = {policy.choose(request(f"{i} different start"), ds).name for i in range(40)}
    assert len(spread) >= 3  # different prefixes spread over the pool
    home = next(d for d in ds if d.name in homes)
    home.in_flight = 10
    assert policy.choose(request(shared + "more"), ds) is not home


def test_prefix_affinity_is_stable_when_another_deployment_leaves():
    ds = [deployment(n) for n in "abcd"]
    policy = PrefixAffinity({})
    before = {i: policy.choose(request(f"prompt {i}"), ds).name for i in range(60)}
    remaining = [d for d in ds if d.name != "d"]
    after = {i: policy.choose(request(f"prompt {i}"), remaining).name for i in range(60)}
    moved = [i for i in before if before[i] != after[i]]
    assert all(before[i] == "d" for i in moved)  # only the departed deployment's prefixes move


@pytest.mark.parametrize("name", ["round_robin", "weighted_random", "least_loaded", "power_of_two", "prefix_affinity"])
def test_builtin_policies_are_registered_through_the_hook(name):
    from gateway.plugins import collect_routing_policies, make_plugin_manager

    registry = collect_routing_policies(make_plugin_manager())
    assert registry.get(name) is not None
    assert registry.owners[name] == "builtin_policies"
