"""`precise_prefix` over vLLM-like engines behind the openai backend: the gateway has no tokenizer
for them, so it asks one of them (POST /tokenize, chat prompts as messages through the server's
template) before it chooses, and matches the ids against the blocks the engines announce on their
KV-event streams. Each upstream here is the scripted OpenAI server with a prefix cache of its own:
a chat request stores its prompt's blocks and publishes them with a plain pyzmq PUB socket,
written from vLLM's wire format (three frames, msgpack batches [ts, events] with map-form events
as vLLM 0.32 sends them, sha256_cbor chained hashes), not from the gateway's or the engine's code."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time

import cbor2
import httpx
import msgspec
import pytest
import zmq
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from starlette.requests import Request
from starlette.responses import JSONResponse

from tests.support.fakes.scripted_upstream import ScriptedUpstream
from tests.support.servers.loopback import GatewayServer

BLOCK = 4
SEED = "0"


def block_hashes(tokens: list[int]) -> list[int]:
    """vLLM v1, --prefix-caching-hash-algo sha256_cbor, PYTHONHASHSEED=SEED, int hashes."""
    parent = hashlib.sha256(cbor2.dumps(SEED, canonical=True)).digest()
    out = []
    for i in range(len(tokens) // BLOCK):
        chunk = tokens[i * BLOCK:(i + 1) * BLOCK]
        parent = hashlib.sha256(cbor2.dumps([parent, chunk, None], canonical=True)).digest()
        out.append(int.from_bytes(parent[-8:], "big"))
    return out


class CachingUpstream(ScriptedUpstream):
    """A vLLM-like server: /tokenize, chat, and a KV-event PUB socket announcing the blocks each
    chat prompt leaves in its cache. While `tokenize_held`, its /tokenize answers nothing (until
    released); `tokenize_answered` counts the answers it gave."""

    def __init__(self):
        self.context = zmq.Context()
        self.pub = self.context.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind("tcp://127.0.0.1:*")
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.seq = 0
        self.cached: set[int] = set()
        self.tokenize_held = False
        self.tokenize_answered = 0
        super().__init__(model="m")

    async def chat(self, request: Request):
        body = await request.json()
        tokens = self.token_ids(body)[0]
        hashes = block_hashes(tokens)
        first = next((i for i, h in enumerate(hashes) if h not in self.cached), len(hashes))
        new = hashes[first:]
        if new:
            self.cached.update(new)
            # As vLLM 0.32 sends it (seen from bench/vllm_server.sh's vLLM): the stored blocks'
            # tokens, the parent of the first one (null at the prompt's start), lora_id null.
            parent = hashes[first - 1] if first else None
            event = {"type": "BlockStored", "block_hashes": new, "parent_block_hash": parent,
                     "token_ids": tokens[first * BLOCK:len(hashes) * BLOCK], "block_size": BLOCK, "lora_id": None}
            self.publish([event])
        return await super().chat(request)

    async def tokenize(self, request: Request):
        body = await request.json()  # read (and kept for the answer) before the client may give up
        if "untokenizable" in json.dumps(body):
            self.seen.append((request.url.path, body))
            return JSONResponse({"error": {"message": "no", "type": "BadRequestError", "code": 400}}, status_code=400)
        while self.tokenize_held:
            await asyncio.sleep(0.01)
        self.tokenize_answered += 1
        return await super().tokenize(request)

    def publish(self, events: list[dict]) -> None:
        payload = msgspec.msgpack.encode([time.time(), events])  # vLLM 0.32's EventBatch is array_like
        self.pub.send_multipart([b"", self.seq.to_bytes(8, "big"), payload])
        self.seq += 1

    def close(self) -> None:
        super().close()
        self.context.destroy(linger=0)


GATEWAY = """
models:
  - name: m
    policy: precise_prefix
    policy_options: {{tokenize_timeout_s: 0.5}}
    deployments:
""" + "".join("""
      - name: vllm-{i}
        backend: openai
        settings:
          base_url: "{{base{i}}}/v1"
          server: vllm
          metrics: none
          kv_events: {{{{endpoint: "{{events{i}}}", block_size: 4, hash_seed: "0"}}}}
""".format(i=i) for i in range(2))

SYSTEM = "You answer questions about the ocean in short plain sentences and cite no sources ever please " * 2


@pytest.fixture(scope="module")
def upstreams():
    ups = [CachingUpstream(), CachingUpstream()]
    ups[1].vocabulary = ups[0].vocabulary  # one model: one tokenizer
    yield ups
    for up in ups:
        up.close()


@pytest.fixture(scope="module")
def exporter():
    return InMemorySpanExporter()


@pytest.fixture(scope="module")
def gw(upstreams, exporter):
    config = GATEWAY.format(**{f"base{i}": up.base_url for i, up in enumerate(upstreams)},
                            **{f"events{i}": up.endpoint for i, up in enumerate(upstreams)})
    with GatewayServer(config, span_exporter=exporter) as server:
        feed = server.state.registry.pools[0].policy.kv_feed
        deadline = time.monotonic() + 10
        while not (len(feed.streams) == 2 and all(s.connected for s in feed.streams.values())):
            chat(server, "warm up")  # the subscriptions start with the pool's first routing
            assert time.monotonic() < deadline, "the gateway did not subscribe to both engines"
            time.sleep(0.05)
        time.sleep(0.3)  # the subscriptions reach the publishers
        yield server


def chat(gw, user: str, system: str = SYSTEM, **extra) -> httpx.Response:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    r = httpx.post(gw.base_url + "/v1/chat/completions", timeout=30,
                   json={"model": "m", "messages": messages, "max_tokens": 5, **extra})
    assert r.status_code == 200, r.text
    return r


def route_of(exporter) -> dict:
    return dict(next(s for s in exporter.get_finished_spans() if s.name == "kvgate.route").attributes)


def tokenized_since(upstreams, counts: list[int]) -> list[dict]:
    """The /tokenize bodies the upstreams received since they had received `counts`."""
    return [b for up, n in zip(upstreams, counts) for b in up.bodies("/tokenize")[n:]]


def wait_indexed(gw, name: str, blocks: int) -> None:
    index = gw.state.registry.pools[0].policy.kv_feed.index
    deadline = time.monotonic() + 10
    while index.blocks_of(name) < blocks:
        assert time.monotonic() < deadline, f"{name}'s blocks did not reach the index"
        time.sleep(0.02)


def test_chat_prompts_are_tokenized_by_the_backend_and_follow_their_cached_prefix(gw, upstreams, exporter):
    exporter.clear()
    chat(gw, "where do whales sleep")
    home = route_of(exporter)["kvgate.deployment"]
    holder = upstreams[int(home[-1])]
    wait_indexed(gw, home, len(holder.cached))
    asked = [len(up.bodies("/tokenize")) for up in upstreams]
    for question in ("how deep is the sea", "why is it salty", "what eats krill"):
        exporter.clear()
        chat(gw, question)
        route = route_of(exporter)
        assert route["kvgate.deployment"] == home
        assert route["kvgate.kv_prefix_matched_tokens"] >= len(SYSTEM.split()) // BLOCK * BLOCK
    sent = tokenized_since(upstreams, asked)
    assert len(sent) == 3  # one /tokenize per new prompt
    assert all(b["messages"][0]["content"] == SYSTEM and "prompt" not in b for b in sent)  # the chat form
    # what changes the rendered prompt goes along, and makes it another prompt
    chat(gw, "what eats krill", chat_template_kwargs={"enable_thinking": False})
    sent = tokenized_since(upstreams, asked)
    assert len(sent) == 4 and any(b.get("chat_template_kwargs") == {"enable_thinking": False} for b in sent)


def test_a_prompt_the_tokenizer_refuses_is_not_held_against_the_server(gw, upstreams):
    tokens = gw.state.registry.pools[0].policy.kv_feed.tokens
    failures, asked = tokens.remote_failures, [len(up.bodies("/tokenize")) for up in upstreams]
    chat(gw, "an untokenizable question")  # its /tokenize answers 400; the request is served all the same
    chat(gw, "a fine question")
    assert len(tokenized_since(upstreams, asked)) == 2 and tokens.remote_failures == failures  # no back-off


def test_a_slow_or_failing_tokenize_routes_by_affinity_and_is_not_asked_again_at_once(gw, upstreams, exporter, caplog):
    policy = gw.state.registry.pools[0].policy
    answered = [up.tokenize_answered for up in upstreams]
    for up in upstreams:
        up.tokenize_held = True  # no answer until the test is done: past any tokenize_timeout_s
    failures = policy.kv_feed.tokens.remote_failures
    try:
        with caplog.at_level(logging.WARNING, logger="kvgate.routing"):
            for question in ("a question the index has never seen", "and another one", "and a third"):
                exporter.clear()
                chat(gw, question, system="another system prompt entirely")
                # served with no /tokenize answered: the route gave up on them (its timeout), no clock read
                assert [up.tokenize_answered for up in upstreams] == answered
                assert route_of(exporter).get("kvgate.kv_prefix_matched_tokens") is None  # by affinity
            assert any("/tokenize on deployment vllm-" in r.getMessage() and "no answer in time" in r.getMessage()
                       for r in caplog.records)
            # each deployment asked (one the index follows: live, or subscribed under the cost model)
            # failed once, then was left alone
            live = sum(policy._followed(name) for name in ("vllm-0", "vllm-1"))
            assert policy.kv_feed.tokens.remote_failures == failures + live
            metrics = httpx.get(gw.base_url + "/metrics").text
            assert f'kvgate_kv_route_tokenize_failures_total{{model="m"}} {float(policy.kv_feed.tokens.remote_failures)}' in metrics
    finally:
        for up in upstreams:
            up.tokenize_held = False
        policy.kv_feed.tokens._backoff.clear()  # the module's other tests ask them again
