"""Routing policies: which of a pool's available deployments takes a request.

A policy gets only deployments that can take a request now (started, healthy, breaker closed,
not saturated) and returns one (the `RoutingPolicy` protocol, gateway/policy.py). Policies are
registered by plugins through `register_routing_policies`; these are the built-in ones.
"""

from __future__ import annotations

import hashlib
import itertools
import random

from gateway.policy import RoutingPolicy


def load_score(deployment) -> float:
    """Lower is less loaded. Backends' own counters, topped up by what the gateway knows it sent
    (a remote backend's counters lag behind), and normalised by capacity when it is known."""
    load = deployment.backend.load()
    running = max(load.running, deployment.in_flight - load.waiting)
    busy = (running + 2 * load.waiting) / (load.capacity or 1)
    return busy + load.kv_cache_usage


class RoundRobin(RoutingPolicy):
    """Each request goes to the next deployment in turn."""

    def __init__(self, options: dict):
        self._counter = itertools.count()

    def choose(self, request, candidates):
        return candidates[next(self._counter) % len(candidates)]


class WeightedRandom(RoutingPolicy):
    """A random deployment, in proportion to the deployments' `weight`."""

    def __init__(self, options: dict):
        self._random = random.Random(options.get("seed"))

    def choose(self, request, candidates):
        return self._random.choices(candidates, weights=[d.weight for d in candidates])[0]


class LeastLoaded(RoutingPolicy):
    """The deployment with the lowest load score per unit of weight; ties are taken in turn, so
    equal deployments share the traffic instead of herding onto the first."""

    def __init__(self, options: dict):
        self._turn = itertools.count()

    def choose(self, request, candidates):
        scores = [load_score(d) / d.weight for d in candidates]
        best = min(scores)
        ties = [d for d, s in zip(candidates, scores) if s - best < 1e-9]
        return ties[next(self._turn) % len(ties)]


class PowerOfTwo(RoutingPolicy):
    """Two deployments picked at random; the less loaded one wins. Cheap, and it does not herd."""

    def __init__(self, options: dict):
        self._random = random.Random(options.get("seed"))

    def choose(self, request, candidates):
        if len(candidates) == 1:
            return candidates[0]
        a, b = self._random.sample(candidates, 2)
        return a if load_score(a) / a.weight <= load_score(b) / b.weight else b


class PrefixAffinity(RoutingPolicy):
    """The same prompt prefix goes to the same deployment, so engine prefix caches hit.

    Rendezvous hashing on the first `prefix_chars` characters of the prompt picks the home
    deployment; the set of candidates can change without moving most prefixes. When the home's
    load score is over `max_score`, the least loaded candidate takes the request instead.
    """

    def __init__(self, options: dict):
        self.prefix_chars = int(options.get("prefix_chars", 256))
        self.max_score = float(options.get("max_score", 1.5))
        self._fallback = LeastLoaded({})

    def home(self, request, candidates):
        """The prompt prefix's home among `candidates`, whatever their load."""
        key = prompt_prefix(request, self.prefix_chars)
        return max(candidates, key=lambda d: _rendezvous(key, d.name))

    def choose(self, request, candidates):
        home = self.home(request, candidates)
        if load_score(home) <= self.max_score:
            return home
        return self._fallback.choose(request, candidates)


def prompt_prefix(request, chars: int) -> str:
    """The start of what a request reads (its messages or prompt; an embeddings request's first
    input; nothing for a request of neither, such as /detokenize)."""
    messages = getattr(request, "messages", None)
    prompt = getattr(request, "prompt", None)
    if prompt is None and getattr(request, "inputs", None):
        prompt = request.inputs[0]
    if messages is not None:
        text = "\x00".join(f"{m['role']}:{m['content']}" for m in messages)
    elif isinstance(prompt, list):
        text = ",".join(map(str, prompt))
    else:
        text = prompt or ""
    return text[:chars]


def _rendezvous(key: str, name: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{name}\x00{key}".encode(), digest_size=8).digest(), "big")


BUILTIN_POLICIES = {
    "round_robin": RoundRobin,
    "weighted_random": WeightedRandom,
    "least_loaded": LeastLoaded,
    "power_of_two": PowerOfTwo,
    "prefix_affinity": PrefixAffinity,
}
