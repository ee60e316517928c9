"""The exact response cache through the real openai client against the echo backend: a repeated
deterministic request is answered without the backend (whole and streamed, usage as asked), every
other request reaches it, and only answers that finished are kept."""

import time

import httpx
import openai
import pytest

from gateway.cache.stores import MemoryCache
from tests.support.servers.loopback import GatewayServer
from tests.support.servers.redis_server import redis_or_skip

ALICE, BOB = "sk-alice-0123456789", "sk-bob-0123456789"
CONFIG = f"""
auth:
  limits_store: {{kind: redis, url_env: KVGATE_TEST_CACHE_REDIS}}
  keys:
    - {{name: alice, key: {ALICE}}}
    - {{name: bob, key: {BOB}}}
budgets:
  limits: [{{name: alice-day, key: alice, limit: 100000, window: day}}]
models:
  - name: echo
    cache: {{ttl_s: 60}}
    deployments: [{{name: echo-0, backend: echo}}]
  - name: shared
    cache: {{ttl_s: 60, store: redis, scope: shared}}
    deployments: [{{name: shared-0, backend: echo}}]
  - name: slow
    cache: {{ttl_s: 60}}
    deployments: [{{name: slow-0, backend: echo, settings: {{tokens_per_second: 20}}}}]
  - name: failing
    cache: {{ttl_s: 60}}
    deployments: [{{name: failing-0, backend: echo, settings: {{fail_after_tokens: 2}}}}]
  - name: plain
    deployments: [{{name: plain-0, backend: echo}}]
"""


@pytest.fixture(scope="module")
def gw():
    redis = redis_or_skip()
    mp = pytest.MonkeyPatch()
    mp.setenv("KVGATE_TEST_CACHE_REDIS", redis.url)
    try:
        with GatewayServer(CONFIG) as server:
            server.calls = {}
            for d in server.state.registry.deployments():  # count what reaches each backend
                _count_calls(server.calls, d.name, d.backend)
            yield server
    finally:
        mp.undo()
        redis.kill()


def _count_calls(calls: dict, name: str, backend) -> None:
    generate = backend.generate

    def counted(request):
        calls[name] = calls.get(name, 0) + 1
        return generate(request)
    backend.generate = counted


def client(gw, key=ALICE):
    return openai.OpenAI(base_url=gw.base_url + "/v1", api_key=key, max_retries=0)


def chat(gw, content, key=ALICE, headers=None, **kw):
    kw.setdefault("temperature", 0)
    return client(gw, key).chat.completions.with_raw_response.create(
        model=kw.pop("model", "echo"), messages=[{"role": "user", "content": content}], max_tokens=5,
        extra_headers=headers, **kw)


def test_a_repeated_greedy_request_is_answered_from_the_cache(gw):
    first = chat(gw, "one two three four")
    calls = gw.calls.get("echo-0", 0)
    again = chat(gw, "one two three four")
    assert (first.headers["x-kvgate-cache"], again.headers["x-kvgate-cache"]) == ("miss", "hit")
    assert gw.calls["echo-0"] == calls  # the backend was not asked again
    a, b = first.parse(), again.parse()
    assert b.choices[0].message.content == a.choices[0].message.content
    assert b.choices[0].finish_reason == a.choices[0].finish_reason and b.usage == a.usage
    assert b.id != a.id


def test_a_stream_hit_replays_the_chunks_with_usage_as_asked(gw):
    def stream(include_usage):
        options = {"include_usage": True} if include_usage else None
        raw = client(gw).chat.completions.with_raw_response.create(
            model="echo", messages=[{"role": "user", "content": "alpha beta gamma"}], max_tokens=4,
            temperature=0, stream=True, stream_options=options)
        chunks = list(raw.parse())
        return raw.headers["x-kvgate-cache"], chunks

    live_header, live = stream(include_usage=True)
    calls = gw.calls["echo-0"]
    hit_header, hit = stream(include_usage=True)
    _, plain = stream(include_usage=False)
    assert (live_header, hit_header) == ("miss", "hit") and gw.calls["echo-0"] == calls
    text = lambda chunks: "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text(hit) == text(live) == text(plain) and text(live)
    finish = lambda chunks: [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish(hit) == finish(live)
    assert hit[-1].usage == live[-1].usage and live[-1].usage is not None
    assert all(c.usage is None for c in plain)  # no include_usage: no usage chunk
    assert hit[0].id != live[0].id and len({c.id for c in hit}) == 1


def test_requests_that_are_not_deterministic_reach_the_backend(gw):
    for kw in ({"temperature": 0.7}, {"temperature": 0, "n": 2}):
        before = gw.calls.get("echo-0", 0)
        headers = {chat(gw, "sampled words here", **kw).headers["x-kvgate-cache"] for _ in range(2)}
        assert headers == {"miss"} and gw.calls["echo-0"] - before == 2 * kw.get("n", 1)
    seeded = [chat(gw, "sampled words here", temperature=0.7, seed=3).headers["x-kvgate-cache"] for _ in range(2)]
    assert seeded == ["miss", "hit"]


def test_cache_control_no_cache_refreshes_and_no_store_bypasses(gw):
    assert chat(gw, "control words", headers={"cache-control": "no-store"}).headers["x-kvgate-cache"] == "miss"
    assert chat(gw, "control words").headers["x-kvgate-cache"] == "miss"  # no-store kept nothing
    before = gw.calls["echo-0"]
    assert chat(gw, "control words", headers={"cache-control": "no-cache"}).headers["x-kvgate-cache"] == "miss"
    assert gw.calls["echo-0"] == before + 1
    assert chat(gw, "control words").headers["x-kvgate-cache"] == "hit"


def test_tenants_do_not_share_entries_unless_the_model_says_so(gw):
    assert chat(gw, "tenant words").headers["x-kvgate-cache"] == "miss"
    assert chat(gw, "tenant words", key=BOB).headers["x-kvgate-cache"] == "miss"  # scope: key
    assert chat(gw, "shared words", model="shared").headers["x-kvgate-cache"] == "miss"
    assert chat(gw, "shared words", model="shared", key=BOB).headers["x-kvgate-cache"] == "hit"  # redis, shared


def test_cut_and_failed_answers_are_not_kept(gw):
    stream = client(gw).completions.create(model="slow", prompt="w " * 30, max_tokens=30, temperature=0, stream=True)
    for i, _ in enumerate(stream):
        if i == 2:
            break
    stream.close()
    time.sleep(0.2)  # (the gateway learns of the disconnect)
    raw = client(gw).completions.with_raw_response.create(model="slow", prompt="w " * 30, max_tokens=30, temperature=0)
    assert raw.headers["x-kvgate-cache"] == "miss"  # the cut stream kept nothing (the key leaves `stream` out)
    for _ in range(2):
        with pytest.raises(openai.APIError):
            list(client(gw).completions.create(model="failing", prompt="a b c d e", max_tokens=5, temperature=0,
                                               stream=True))
    assert gw.calls["failing-0"] == 2


def test_a_hit_costs_no_tokens_of_the_budget(gw):
    chat(gw, "budget words words")
    spend = lambda: next(b for b in httpx.get(gw.base_url + "/key/info", headers={"authorization": f"Bearer {ALICE}"},
                                              timeout=10).json()["budgets"])
    deadline = time.monotonic() + 10
    while spend()["reserved"] and time.monotonic() < deadline:
        time.sleep(0.02)
    before = spend()["spend"]
    assert chat(gw, "budget words words").headers["x-kvgate-cache"] == "hit"
    time.sleep(0.1)
    assert spend()["spend"] == before


def test_models_without_a_cache_send_no_header(gw):
    assert "x-kvgate-cache" not in chat(gw, "plain words", model="plain").headers


def test_the_memory_store_evicts_the_least_recently_used_by_bytes():
    import asyncio

    async def main():
        cache = MemoryCache(max_bytes=100, ttl_s=60)
        cache.put("a", b"x" * 40)
        cache.put("b", b"y" * 40)
        assert await cache.get("a") == b"x" * 40  # a is now the most recent
        cache.put("c", b"z" * 40)  # 120 > 100: b goes
        assert await cache.get("b") is None and await cache.get("a") is not None and cache.bytes == 80
        cache.put("d", b"w" * 101)  # larger than the whole cache: not kept
        assert await cache.get("d") is None
    asyncio.run(main())


def test_a_redis_cache_needs_the_limits_store_redis():
    from gateway.config import ConfigError, parse_config
    with pytest.raises(ConfigError, match=r"models\[0\].cache.store: redis is auth.limits_store's Redis"):
        parse_config("models: [{name: e, cache: {store: redis}, deployments: [{name: e0, backend: echo}]}]\n")


def test_hits_show_in_the_metrics(gw):
    def ttft_count():
        text = gw.state.metrics.exposition().decode()
        line = next(x for x in text.splitlines()
                    if x.startswith("kvgate_time_to_first_token_seconds_count") and 'model="echo"' in x)
        return float(line.split()[-1])
    chat(gw, "metric words")
    timed = ttft_count()
    assert chat(gw, "metric words").headers["x-kvgate-cache"] == "hit"
    assert ttft_count() == timed  # a hit generated nothing now: not a TTFT (nor ITL) of the model
    text = gw.state.metrics.exposition().decode()
    hits = [line for line in text.splitlines()
            if line.startswith('kvgate_response_cache_requests_total{model="echo",result="hit"}')]
    assert hits and float(hits[0].split()[-1]) >= 1
    assert 'deployment="cache"' in text and 'result="stored"' in text and 'result="bypass"' in text


def test_a_hit_is_traced_without_a_backend_attempt():
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import SpanKind

    exporter = InMemorySpanExporter()
    config = "models: [{name: echo, cache: {}, deployments: [{name: e0, backend: echo}]}]\n"
    with GatewayServer(config, span_exporter=exporter) as server:
        body = {"model": "echo", "messages": [{"role": "user", "content": "traced words"}], "max_tokens": 3,
                "temperature": 0}
        for _ in range(2):
            assert httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=10).status_code == 200
        deadline = time.monotonic() + 10
        while len([s for s in exporter.get_finished_spans() if s.kind == SpanKind.SERVER]) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    spans = exporter.get_finished_spans()
    roots = [s for s in spans if s.kind == SpanKind.SERVER]
    assert [r.attributes["kvgate.cache"] for r in roots] == ["miss", "hit"]
    attempts = [s for s in spans if s.kind == SpanKind.CLIENT]
    assert {a.context.trace_id for a in attempts} == {roots[0].context.trace_id}  # the miss's attempt only


def test_a_replay_follows_the_entry_the_store_answers_now():
    """Hits reuse an entry's decoded events while the store answers the same bytes under its key;
    an entry stored again under that key (another answer) replays the new events."""
    from prometheus_client import CollectorRegistry, Counter

    from gateway.backend import TokenEvent, Usage
    from gateway.cache.entries import encode
    from gateway.cache.responses import Lookup, ResponseCache
    from gateway.config import ResponseCacheConfig

    requests = Counter("c", "c", ["model", "outcome"], registry=CollectorRegistry())
    cache = ResponseCache("m", ResponseCacheConfig(), MemoryCache(2**20, 60), requests)

    def stored(text: str) -> bytes:
        return encode([(0, [TokenEvent(text=text), TokenEvent(finish_reason="stop", usage=Usage(3, 2))])])

    def replayed(data: bytes) -> list[str]:
        return [e.text for c in cache.replay(Lookup("k", True, hit=data)) for e in c.events]

    first = stored("one")
    assert replayed(first) == replayed(first) == ["one", ""]
    assert replayed(stored("two")) == ["two", ""]  # same key, new bytes: not the old events
    assert replayed(bytes(first)) == ["one", ""]
