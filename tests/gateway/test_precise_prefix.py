"""`precise_prefix` routes by what the engines report they cache: a prompt goes to the deployment
holding the longest run of its blocks, load tempers it, and without live events it routes as
`prefix_affinity` does. Each "engine" here is a real block manager publishing through the
engine's own KV-event publisher; the deployments are echo backends that declare those events."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
import zmq
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from gateway.backend import GenerationRequest, KVEventsSource, LoadSnapshot, SamplingParams
from gateway.hookspecs import hookimpl
from gateway.kv_index import index as kv_index
from gateway.pools.breaker import CircuitBreaker
from gateway.pools.registry import Deployment
from gateway.routing.policies import PrefixAffinity
from gateway.routing.precise_prefix import PrecisePrefix
from kvgate_echo import EchoBackend, EchoSettings
from native_backend.config.engine import KVEventsOptions
from native_backend.core.block_manager import BlockManager
from native_backend.core.sequence import Sequence
from native_backend.process.kv_publisher import KVEventPublisher
from tests.support.servers.loopback import GatewayServer

BLOCK = 4


class Engine:
    """A prefix cache that publishes what it stores, as the native engine does."""

    def __init__(self):
        self.blocks = BlockManager(num_blocks=256, block_size=BLOCK, record_kv_events=True)
        self.publisher = KVEventPublisher(KVEventsOptions(endpoint="tcp://127.0.0.1:*"))  # the port it binds
        self.port = int(self.publisher.bound_endpoint.rsplit(":", 1)[1])

    def serve(self, tokens: list[int], cache_salt: str | None = None) -> None:
        seq = Sequence(f"r{time.monotonic_ns()}", tokens)
        seq.cache_salt = cache_salt
        cached = self.blocks.get_computed_prefix(seq)
        self.blocks.allocate_slots(seq, len(tokens) - cached, cached)
        seq.num_computed_tokens = len(tokens)
        self.blocks.cache_full_blocks(seq)
        self.publisher.publish(self.blocks.take_kv_events())


class PublishingEcho(EchoBackend):
    """An echo backend in front of `engine`: it declares the engine's events and reads token-id prompts."""

    def __init__(self, name: str, engine: Engine | None):
        super().__init__(EchoSettings(), name=name)
        self.engine = engine

    def kv_events_source(self):
        return KVEventsSource(f"tcp://127.0.0.1:{self.engine.port}", block_size=BLOCK) if self.engine else None

    def prompt_token_ids(self, request):
        return request.prompt if isinstance(request.prompt, list) else None


def deployment(name: str, engine: Engine | None) -> Deployment:
    return Deployment(name, "m", "m", 1.0, PublishingEcho(name, engine), CircuitBreaker(3, 1.0), started=True)


def request(tokens, request_id="r", cache_salt=None):
    return GenerationRequest(request_id=request_id, model="m", sampling=SamplingParams(), prompt=tokens,
                             extra={"cache_salt": cache_salt} if cache_salt else {})


SYSTEM_A = list(range(100, 132))  # 8 blocks
SYSTEM_B = list(range(500, 532))


async def settle(policy, ds, condition, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        policy.kv_feed.track(ds)
        assert time.monotonic() < deadline, "the index did not catch up"
        await asyncio.sleep(0.02)


BLEND = {"cost_model": False, "provisional_ttl_s": 0}  # the policy as it was before issue 44


def with_engines(scenario, n=3, options=None):
    async def main():
        engines = [Engine() for _ in range(n)]
        ds = [deployment(f"d{i}", e) for i, e in enumerate(engines)]
        policy = PrecisePrefix(options or {})
        policy.kv_feed.track(ds)
        try:
            await settle(policy, ds, lambda: all(s.connected for s in policy.kv_feed.streams.values()))
            await asyncio.sleep(0.3)  # subscriptions reach the publishers
            await scenario(policy, ds, engines)
        finally:
            await policy.kv_feed.close()
            for e in engines:
                e.publisher.close()
    asyncio.run(main())


def test_a_prompt_goes_to_the_engine_holding_its_longest_prefix():
    async def scenario(policy, ds, engines):
        engines[1].serve(SYSTEM_A + [1, 2, 3, 4])
        engines[2].serve(SYSTEM_B + [1, 2, 3, 4])
        engines[0].serve(SYSTEM_A[:8])  # only the first 2 blocks of A
        await settle(policy, ds, lambda: policy.kv_feed.index.blocks_of("d1") == 9 and
                     policy.kv_feed.index.blocks_of("d2") == 9 and policy.kv_feed.index.blocks_of("d0") == 2)
        assert policy.choose(request(SYSTEM_A + [9] * 12, "qa"), ds).name == "d1"
        assert policy.matched_tokens("qa") == 32
        assert policy.choose(request(SYSTEM_B + [7] * 5, "qb"), ds).name == "d2"
        assert policy.choose(request(SYSTEM_A[:8] + [0] * 30, "q0"), ds).name in {"d0", "d1"}  # both hold 2 blocks
        assert policy.matched_tokens("q0") == 8
    with_engines(scenario)


def test_a_salted_prompt_matches_only_blocks_stored_under_its_salt():
    """The engine hashes a salted prompt's blocks apart (cache_salt on the first block): the index
    looks them up the same way, so a tenant's prompt goes where its own salt's blocks are, and
    another salt's (or no salt's) blocks of the same tokens count for nothing (issue 40 item 4)."""
    async def scenario(policy, ds, engines):
        engines[1].serve(SYSTEM_A + [1, 2, 3, 4], cache_salt="tenant-a")
        engines[2].serve(SYSTEM_A + [1, 2, 3, 4])
        await settle(policy, ds, lambda: policy.kv_feed.index.blocks_of("d1") == 9 and
                     policy.kv_feed.index.blocks_of("d2") == 9)
        assert policy.choose(request(SYSTEM_A + [9] * 4, "qa", cache_salt="tenant-a"), ds).name == "d1"
        assert policy.matched_tokens("qa") == 32
        assert policy.choose(request(SYSTEM_A + [9] * 4, "qn"), ds).name == "d2"
        assert policy.matched_tokens("qn") == 32
        policy.choose(request(SYSTEM_A + [9] * 4, "qb", cache_salt="tenant-b"), ds)
        assert policy.matched_tokens("qb") == 0  # held by nobody under its salt: affinity places it
    with_engines(scenario)


def test_a_prompt_nobody_holds_goes_home_by_affinity():
    async def scenario(policy, ds, engines):
        engines[0].serve(SYSTEM_A)
        await settle(policy, ds, lambda: policy.kv_feed.index.blocks_of("d0") == 8)
        affinity = PrefixAffinity({})
        for i in range(10):
            r = request(SYSTEM_B[:-1] + [i] * 9, f"cold{i}")
            assert policy.choose(r, ds) is affinity.choose(r, ds)
            assert policy.matched_tokens(f"cold{i}") == 0
    with_engines(scenario, options=BLEND)


def test_load_tempers_the_prefix_so_a_hot_engine_does_not_take_everything():
    async def scenario(policy, ds, engines):
        engines[0].serve(SYSTEM_A)
        await settle(policy, ds, lambda: policy.kv_feed.index.blocks_of("d0") == 8)
        prompt = SYSTEM_A + list(range(40))  # 32 of 72 tokens cached on d0: a 0.44 head start
        assert policy.choose(request(prompt), ds).name == "d0"
        ds[0].in_flight = 1  # load score 1 (no capacity known): more than the head start
        assert policy.choose(request(prompt), ds).name != "d0"
    with_engines(scenario, options=BLEND)


def test_a_conversations_next_turn_finds_its_engine_before_the_engines_events_say_so():
    """Issue 44 item 2: every engine holds the shared system prompt; three conversations' first
    turns go one to each engine, and their second turns come before any engine published the
    first turns' blocks (the engines here never do). The gateway's provisional entries send each
    to the engine its first turn went to. With provisional_ttl_s 0 the second turns tie on the
    system prompt and go in turn (c2 to d0): it failed so."""
    async def scenario(policy, ds, engines):
        for e in engines:
            e.serve(SYSTEM_A)
        await settle(policy, ds, lambda: all(policy.kv_feed.index.blocks_of(d.name) == 8 for d in ds))
        turns = {c: SYSTEM_A + [1000 + 10 * c + k for k in range(8)] for c in range(3)}  # 2 blocks of its own
        first = {c: policy.choose(request(turns[c], f"c{c}t1"), ds).name for c in range(3)}
        assert sorted(first.values()) == ["d0", "d1", "d2"]  # tied on the system prompt: in turn
        for c in reversed(range(3)):  # the next turn: history + answer + a new question
            second = policy.choose(request(turns[c] + [2000 + c] * 8, f"c{c}t2"), ds).name
            assert second == first[c]
            assert policy.matched_tokens(f"c{c}t2") == 40  # the system prompt + its first turn's blocks
    with_engines(scenario, options={"cost_model": False})


def test_the_cost_model_keeps_a_turn_where_its_history_is_when_the_queue_costs_less():
    """Issue 44 item 1. Every engine holds the 32-token system prompt, d0 also the conversation's
    24 tokens after it; d0 decodes 2 requests, d1 and d2 none. The prompt has 64 tokens. With
    tokens_per_s 1000 and step_s 0.005 (no engine exports rates here), worked by hand:
        d0: (0 queued + 64 - 56) / 1000 + 2 x 0.005 = 0.018 s
        d1, d2: (0 + 64 - 32) / 1000 + 0 = 0.032 s
    so d0, estimated 18 ms, shown on the status page's sample. The blend (cost_model false) scores
    d0 56/64 - 2 = -1.125 against d1's 32/64 = 0.5 and sends it away: the test failed so."""
    async def scenario(policy, ds, engines):
        conversation = SYSTEM_A + list(range(700, 724))
        for e in engines:
            e.serve(SYSTEM_A)
        engines[0].serve(conversation)
        await settle(policy, ds, lambda: policy.kv_feed.index.blocks_of("d0") == 14 and
                     policy.kv_feed.index.blocks_of("d2") == 8)
        ds[0].backend._running.update({"x", "y"})  # the echo's running count: 2 decoding
        prompt = conversation + list(range(900, 908))
        assert policy.choose(request(prompt, "turn"), ds).name == "d0"
        assert policy.matched_tokens("turn") == 56
        assert policy.recent_routes()[-1] | {"at": 0} == {
            "request_id": "turn", "deployment": "d0", "prompt_tokens": 64, "matched_tokens": 56,
            "estimate_ms": 18.0, "at": 0}
    with_engines(scenario, options={"tokens_per_s": 1000, "step_s": 0.005, "provisional_ttl_s": 0,
                                    "route_sample_every": 1})


def test_before_any_engine_published_the_cost_model_places_turns_with_provisional_entries():
    """Engines subscribed to but silent so far (a gateway just started or reloaded): the cost model
    routes on the gateway's own entries instead of falling back to affinity for every request.
    Turn 1 of a conversation goes to one engine; its turn 2 finds it there, 40 of its 48 tokens
    matched (turn 1's 10 full blocks of 4), though no engine published anything. With only live
    streams used (nothing heard: affinity decides, nothing matched) the test failed (None)."""
    async def scenario(policy, ds, engines):
        turn1 = SYSTEM_A + list(range(800, 808))  # 40 tokens
        first = policy.choose(request(turn1, "t1"), ds)
        assert policy.matched_tokens("t1") == 0
        assert policy.choose(request(turn1 + list(range(900, 908)), "t2"), ds) is first
        assert policy.matched_tokens("t2") == 40
    with_engines(scenario)


def test_a_restarted_or_departed_engine_is_forgotten():
    async def scenario(policy, ds, engines):
        engines[0].serve(SYSTEM_A)
        engines[1].serve(SYSTEM_B)
        await settle(policy, ds, lambda: policy.kv_feed.index.blocks_of("d1") == 8)
        ds[0].backend.load = lambda: LoadSnapshot(incarnation=1)  # a new engine process
        policy.kv_feed.track(ds)
        assert policy.kv_feed.index.blocks_of("d0") == 0
        policy.kv_feed.retain([ds[0], ds[2]])  # d1 left the pool (drained, or gone from DNS)
        assert policy.kv_feed.index.blocks_of("d1") == 0 and "d1" not in policy.kv_feed.streams
    with_engines(scenario)


def test_an_engines_prefix_cache_reset_empties_its_entries():
    async def scenario(policy, ds, engines):
        engines[0].serve(SYSTEM_A)
        engines[1].serve(SYSTEM_A)
        await settle(policy, ds, lambda: policy.kv_feed.index.blocks_of("d1") == 8)
        engines[1].blocks.reset_prefix_cache()
        engines[1].publisher.publish(engines[1].blocks.take_kv_events())  # AllBlocksCleared
        await settle(policy, ds, lambda: policy.kv_feed.index.blocks_of("d1") == 0)
        assert policy.kv_feed.index.blocks_of("d0") == 8 and policy.kv_feed.live("d1")
        assert policy.choose(request(SYSTEM_A + [1] * 4, "after-reset"), ds).name == "d0"
    with_engines(scenario)


def test_routing_goes_on_when_a_publisher_disappears():
    async def scenario(policy, ds, engines):
        engines[0].serve(SYSTEM_A)
        engines[1].serve(SYSTEM_B)
        await settle(policy, ds, lambda: policy.kv_feed.live("d0") and policy.kv_feed.live("d1"))
        engines[0].publisher.close()  # its engine is gone (or unreachable): what it held is unknown now
        await settle(policy, ds, lambda: not policy.kv_feed.live("d0"))
        r = request(SYSTEM_A + [5] * 8, "after")
        assert policy.choose(r, ds) is PrefixAffinity({}).choose(r, ds)  # no live one holds it: affinity
        assert policy.matched_tokens("after") == 0
    with_engines(scenario)


def test_without_live_events_it_routes_as_prefix_affinity():
    async def scenario():
        ds = [deployment(f"d{i}", None) for i in range(4)]  # no events declared
        policy, affinity = PrecisePrefix({"prefix_chars": 16}), PrefixAffinity({"prefix_chars": 16})
        for i in range(20):
            r = request([i, i + 1, i + 2] * 5)
            assert policy.choose(r, ds) is affinity.choose(r, ds)
        assert policy.matched_tokens("r") is None
        await policy.kv_feed.close()
    asyncio.run(scenario())


def test_unknown_options_are_refused_by_name():
    with pytest.raises(ValueError, match="unknown option.*prefix_weigth"):
        PrecisePrefix({"prefix_weigth": 2})


def test_it_is_registered_through_the_hook():
    from gateway.plugins import collect_routing_policies, make_plugin_manager

    registry = collect_routing_policies(make_plugin_manager())
    assert registry.get("precise_prefix") is PrecisePrefix


def test_an_openai_deployment_declaring_its_engines_events_is_indexed_too():
    """A vLLM engine behind the openai backend: the gateway follows the events its settings name
    (here published by our engine's publisher, which speaks vLLM's format)."""
    from kvgate_openai import make_openai_backend

    async def scenario():
        engine = Engine()
        backend = make_openai_backend({"base_url": "http://127.0.0.1:9/v1", "kv_events": {
            "endpoint": f"tcp://127.0.0.1:{engine.port}", "block_size": BLOCK, "hash_seed": "0"}}, "vllm-0")
        d = Deployment("vllm-0", "m", "m", 1.0, backend, CircuitBreaker(3, 1.0), started=True)
        policy = PrecisePrefix({})
        try:
            policy.kv_feed.track([d])
            await settle(policy, [d], lambda: policy.kv_feed.streams["vllm-0"].connected)
            await asyncio.sleep(0.3)
            engine.serve(SYSTEM_A)
            await settle(policy, [d], lambda: policy.kv_feed.index.blocks_of("vllm-0") == 8)
            assert policy.kv_feed.live("vllm-0")
        finally:
            await policy.kv_feed.close()
            engine.publisher.close()
    asyncio.run(scenario())


def test_openai_kv_events_settings_are_checked():
    from kvgate_openai import make_openai_backend

    with pytest.raises(ValueError, match="kv_events.endpoint.*not a ZMQ address"):
        make_openai_backend({"base_url": "http://h/v1", "kv_events": {"endpoint": "vllm-0:5557"}}, "x")


class PublishingEchoPlugin:
    """Registers `kv_echo`: an echo backend in front of one of `engines` (settings: {engine: i})."""

    def __init__(self, engines):
        self.engines = engines

    @hookimpl
    def register_backends(self, register, config):
        register("kv_echo", lambda settings, name: PublishingEcho(name, self.engines[settings["engine"]]))


GATEWAY = """
models:
  - name: m
    policy: precise_prefix
    policy_options: {route_sample_every: 1}
    deployments:
      - {name: d0, backend: kv_echo, settings: {engine: 0}}
      - {name: d1, backend: kv_echo, settings: {engine: 1}}
"""


def test_through_the_gateway_the_route_span_metrics_and_status_page_show_the_index():
    engines = [Engine(), Engine()]
    exporter = InMemorySpanExporter()
    try:
        with GatewayServer(GATEWAY, extra_plugins={"kv_echo": PublishingEchoPlugin(engines)},
                           span_exporter=exporter) as gw:
            deadline = time.monotonic() + 10
            while True:  # the subscribers start with the pool; the first request finds them connected
                httpx.post(gw.base_url + "/v1/completions", json={"model": "m", "prompt": [1, 2, 3], "max_tokens": 1})
                streams = gw.state.registry.pools[0].policy.kv_feed.streams
                if len(streams) == 2 and all(s.connected for s in streams.values()):
                    break
                assert time.monotonic() < deadline
                time.sleep(0.1)
            time.sleep(0.3)
            engines[1].serve(SYSTEM_B)
            pool = gw.state.registry.pools[0]
            while pool.policy.kv_feed.index.blocks_of("d1") < 8:
                assert time.monotonic() < deadline + 10
                time.sleep(0.05)
            exporter.clear()
            r = httpx.post(gw.base_url + "/v1/completions", json={"model": "m", "prompt": SYSTEM_B + [3, 4], "max_tokens": 2})
            assert r.status_code == 200
            route = next(s for s in exporter.get_finished_spans() if s.name == "kvgate.route")
            assert route.attributes["kvgate.deployment"] == "d1"
            assert route.attributes["kvgate.kv_prefix_matched_tokens"] == 32
            status = httpx.get(gw.base_url + "/status.json").json()
            views = {d["name"]: d for d in status["models"][0]["deployments"]}
            assert views["d1"]["kv_index"] == {"blocks": 8, "live": True}
            assert views["d0"]["kv_index"]["blocks"] == 0
            route = status["models"][0]["recent_routes"][-1]  # the sampled decision, with its estimate
            assert (route["deployment"], route["prompt_tokens"], route["matched_tokens"]) == ("d1", 34, 32)
            assert route["estimate_ms"] > 0
            assert "Recent routes" in httpx.get(gw.base_url + "/status").text
            metrics = httpx.get(gw.base_url + "/metrics").text
            assert 'kvgate_kv_index_deployment_blocks{deployment="d1",model="m"} 8.0' in metrics
            assert 'kvgate_kv_events_batches_total{deployment="d1",model="m"}' in metrics
            assert 'kvgate_kv_index_blocks{model="m"} 8.0' in metrics
    finally:
        for e in engines:
            e.publisher.close()


class CountingPublisher:
    """A bare PUB socket that counts the subscribers connecting to it (for PublishingEcho)."""

    def __init__(self):
        self.context = zmq.Context()
        self.pub = self.context.socket(zmq.PUB)
        self.pub.bind("tcp://127.0.0.1:*")
        self.port = int(self.pub.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
        self.monitor = self.pub.get_monitor_socket(zmq.EVENT_ACCEPTED)

    def subscribers_accepted(self, quiet_s: float = 0.5) -> int:
        """Connections accepted so far, counted once none has come for `quiet_s`."""
        count = 0
        while self.monitor.poll(int(quiet_s * 1000)):
            self.monitor.recv_multipart()
            count += 1
        return count

    def close(self) -> None:
        self.pub.disable_monitor()
        self.context.destroy(linger=0)


DISAGGREGATED = """
models:
  - name: m
    policy: precise_prefix
    deployments:
      - {name: p0, backend: kv_echo, role: prefill, settings: {engine: 0}}
      - {name: d0, backend: kv_echo, role: decode, settings: {engine: 1}}
      - {name: d1, backend: kv_echo, role: decode, settings: {engine: 2}}
"""


def test_a_disaggregated_models_two_policies_share_one_subscription_per_engine():
    publishers = [CountingPublisher() for _ in range(3)]
    try:
        with GatewayServer(DISAGGREGATED, extra_plugins={"kv_echo": PublishingEchoPlugin(publishers)}) as gw:
            pool = gw.state.registry.pools[0]
            decode, prefill = pool.policy, pool.prefill_policy
            assert prefill is not decode and prefill.kv_feed is decode.kv_feed and pool.kv_feeds() == [decode.kv_feed]
            deadline = time.monotonic() + 10
            while not all(s.connected for s in decode.kv_feed.streams.values()) or len(decode.kv_feed.streams) < 3:
                assert time.monotonic() < deadline, "the gateway did not subscribe"
                time.sleep(0.05)
            r = httpx.post(gw.base_url + "/v1/completions", json={"model": "m", "prompt": [1, 2, 3] * 200, "max_tokens": 1})
            assert r.status_code == 200
            assert [p.subscribers_accepted() for p in publishers] == [1, 1, 1]
            views = {d["name"]: d for d in httpx.get(gw.base_url + "/status.json").json()["models"][0]["deployments"]}
            assert views["p0"]["kv_index"] == {"blocks": 0, "live": False}  # the prefill engine is shown too
            assert 'kvgate_kv_events_batches_total{deployment="p0",model="m"} 0.0' in httpx.get(gw.base_url + "/metrics").text
    finally:
        for p in publishers:
            p.close()


def test_the_reset_route_names_what_it_reset_and_refuses_an_unknown_model(monkeypatch):
    """The native engines' side is tests/plugins/test_native_kv_routing.py; here backends without a
    prefix cache to reset, and the route's refusals."""
    monkeypatch.setenv("KVGATE_TEST_RESET_ADMIN", "admin-key-for-the-reset")
    admin = {"authorization": "Bearer admin-key-for-the-reset"}
    engines = [Engine(), Engine()]
    try:
        with GatewayServer("auth: {admin_key_env: KVGATE_TEST_RESET_ADMIN}\n" + GATEWAY,
                           extra_plugins={"kv_echo": PublishingEchoPlugin(engines)}) as gw:
            url = gw.base_url + "/admin/reset_prefix_cache"
            assert httpx.post(url).status_code == 401
            r = httpx.post(url, params={"model": "nope"}, headers=admin)
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
            r = httpx.post(url, params={"model": "m"}, headers=admin)
            assert r.json() == {"reset": [], "unavailable": [], "not_supported": ["d0", "d1"]}
    finally:
        for e in engines:
            e.publisher.close()


def test_a_prompt_is_hashed_only_as_far_as_an_engine_holds_it(monkeypatch):
    """`choose` runs on the event loop: a long prompt's blocks are hashed up to the first one no
    live engine holds, not to its end (sha256 over CBOR: ~80 us a block, ~40 ms for 8k tokens)."""
    async def scenario(policy, ds, engines):
        engines[0].serve(SYSTEM_A[:8])  # 2 blocks
        await settle(policy, ds, lambda: policy.kv_feed.index.blocks_of("d0") == 2)
        kv_index._root("0")  # the chain's root, cached once per seed
        hashed, real = [], kv_index._sha256_cbor
        monkeypatch.setattr(kv_index, "_sha256_cbor", lambda value: hashed.append(value) or real(value))
        assert policy.choose(request(SYSTEM_A[:8] + list(range(1000, 1400)), "long"), ds).name == "d0"
        assert policy.matched_tokens("long") == 8
        assert len(hashed) == 3  # the 2 blocks d0 holds and the first it does not, of 102
    with_engines(scenario, options={"provisional_ttl_s": 0})


def test_provisional_entries_hash_a_bounded_number_of_blocks_past_the_lookup(monkeypatch):
    """The chosen engine's provisional entries hash on past the lookup, at most
    provisional_max_blocks more: the event loop's cost stays bounded for a long prompt."""
    async def scenario(policy, ds, engines):
        engines[0].serve(SYSTEM_A[:8])  # 2 blocks
        await settle(policy, ds, lambda: policy.kv_feed.index.blocks_of("d0") == 2)
        kv_index._root("0")
        hashed, real = [], kv_index._sha256_cbor
        monkeypatch.setattr(kv_index, "_sha256_cbor", lambda value: hashed.append(value) or real(value))
        assert policy.choose(request(SYSTEM_A[:8] + list(range(1000, 1400)), "long"), ds).name == "d0"
        assert len(hashed) == 3 + 5  # the lookup's 3, then 5 more for the provisional entries
        assert policy.kv_feed.index.provisional_count() == 6  # the 3rd to 8th blocks: d0 holds the first 2
    with_engines(scenario, options={"provisional_max_blocks": 5})
