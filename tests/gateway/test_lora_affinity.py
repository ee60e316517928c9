"""lora_affinity over several engines (echo backends reporting LoRA state as the native engine's
stats do): an adapter's request goes where it runs, else to a free slot, else where it already
waits, blended with load; base requests by load alone. The expected order is llm-d's
lora-affinity scorer's (1.0 running, 0.8 free slot, 0.6 waiting, 0.0 full: WIRE_FORMATS 9). Also
vLLM's vllm:lora_requests_info as /metrics exports it (label names from vLLM's
vllm/v1/metrics/loggers.py), ModelPool.take sending an adapter only to deployments holding it, and
/status.json showing each deployment's adapters."""

from __future__ import annotations

import dataclasses
from collections import Counter

import httpx
import pytest

from gateway.backend import GenerationRequest, LoRAState, SamplingParams
from gateway.capabilities import Needs
from gateway.observability.metrics import _lora_requests_info
from gateway.pools.breaker import CircuitBreaker
from gateway.pools.registry import Deployment
from gateway.routing.lora_affinity import LoRAAffinity
from kvgate_echo import EchoBackend, EchoSettings
from tests.support.servers.loopback import GatewayServer

VLLM_LABELS = ["max_lora", "waiting_lora_adapters", "running_lora_adapters"]  # vLLM's, in its order


class LoRAEcho(EchoBackend):
    """An echo backend whose load says which adapters it serves, runs and queues."""

    def __init__(self, name: str, lora: LoRAState | None):
        super().__init__(EchoSettings(max_concurrency=8), name=name)
        self.lora = lora

    def load(self):
        return dataclasses.replace(super().load(), lora=self.lora)


def engine(name, running=(), waiting=(), max_loras=2, adapters=("x", "y", "z"), in_flight=0):
    lora = LoRAState(max_loras, {a: f"/adapters/{a}" for a in adapters}, tuple(running), tuple(waiting))
    d = Deployment(name, "m", "m", 1.0, LoRAEcho(name, lora), CircuitBreaker(3, 1.0), started=True)
    d.in_flight = in_flight
    return d


def request(adapter=None):
    return GenerationRequest("r", "m", SamplingParams(), prompt="hi", needs=Needs("completions", adapter=adapter))


def test_an_adapter_goes_where_it_runs_then_to_a_free_slot_then_where_it_waits():
    policy = LoRAAffinity({})
    running = engine("running", running=["x", "y"])  # x active; both slots taken
    free = engine("free", running=["z"])  # a free slot
    full = engine("full", running=["y", "z"], waiting=["x"])  # x queued behind full slots
    assert policy.choose(request("x"), [free, full, running]) is running
    assert policy.choose(request("x"), [full, free]) is free
    assert policy.choose(request("x"), [engine("other-full", running=["y", "z"]), full]) is full


def test_load_outweighs_affinity_past_its_margin_and_base_requests_go_by_load():
    policy = LoRAAffinity({})
    # 8 in flight of capacity 8 is a load score of 1: more than the 0.2 between running and a free slot
    hot = engine("hot", running=["x"], in_flight=8)
    cool = engine("cool", running=[])
    assert policy.choose(request("x"), [hot, cool]) is cool
    warm = engine("warm", running=["x"], in_flight=1)  # 1/8 < 0.2: affinity still wins
    assert policy.choose(request("x"), [warm, cool]) is warm
    picks = Counter(policy.choose(request(None), [warm, cool]).name for _ in range(4))
    assert picks == {"cool": 4}  # the base model: load alone
    assert Counter(policy.choose(request(None), [engine("a"), engine("b")]).name for _ in range(4)) == {"a": 2, "b": 2}


def test_bad_options_are_refused_naming_them():
    with pytest.raises(ValueError, match="lora_affinity: unknown option.*prefix_weight"):
        LoRAAffinity({"prefix_weight": 1})
    with pytest.raises(ValueError, match="must be >= 0"):
        LoRAAffinity({"load_weight": -1})


def test_lora_requests_info_has_vllms_labels_and_values_per_engine():
    engines = [engine("e0", running=["x", "y"], waiting=["z"]), engine("e1", max_loras=4),
               Deployment("plain", "m", "m", 1.0, LoRAEcho("plain", None), CircuitBreaker(3, 1.0), started=True)]
    registry = type("Registry", (), {"deployments": lambda self: engines})()
    (family,) = list(_lora_requests_info(registry))
    assert family.name == "vllm:lora_requests_info"
    got = sorted(((s.labels, s.value > 0) for s in family.samples), key=lambda sample: sample[0]["engine"])
    assert [list(labels)[:3] for labels, _ in got] == [VLLM_LABELS, VLLM_LABELS]  # no series for "plain"
    assert got == [({"max_lora": "2", "waiting_lora_adapters": "z", "running_lora_adapters": "x,y",
                     "model_name": "m", "engine": "e0"}, True),
                   ({"max_lora": "4", "waiting_lora_adapters": "", "running_lora_adapters": "",
                     "model_name": "m", "engine": "e1"}, True)]


def test_an_adapters_requests_go_only_to_deployments_that_hold_it_under_the_registered_policy():
    config = """
models:
  - name: m
    policy: lora_affinity
    deployments: [{name: a, backend: echo}, {name: b, backend: echo}]
"""
    with GatewayServer(config) as gw:
        pool = gw.state.registry.pools[0]
        assert isinstance(pool.policy, LoRAAffinity)
        a, b = pool.deployments
        a.backend.load = lambda: dataclasses.replace(EchoBackend.load(a.backend),
                                                     lora=LoRAState(1, {"x": "/x"}, ("x",), ()))
        b.backend.load = lambda: dataclasses.replace(EchoBackend.load(b.backend), lora=LoRAState(1, {}))
        for _ in range(4):
            chosen = pool.take(request("x"))
            assert chosen is a
            pool.release(chosen)
        assert pool.take(request("nope")) is None
        answer = httpx.post(gw.base_url + "/v1/completions", json={"model": "x", "prompt": "hi", "max_tokens": 2})
        assert answer.status_code == 200 and answer.json()["model"] == "x"
        models = httpx.get(gw.base_url + "/v1/models").json()["data"]
        assert [(m["id"], m["parent"], m["root"]) for m in models] == [("m", None, "m"), ("x", "m", "/x")]
        status = {d["name"]: d["lora"] for d in httpx.get(gw.base_url + "/status.json").json()["models"][0]["deployments"]}
        assert status == {"a": {"adapters": ["x"], "running": ["x"], "waiting": [], "max_loras": 1},
                          "b": {"adapters": [], "running": [], "waiting": [], "max_loras": 1}}
