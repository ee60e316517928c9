"""Prefill/decode disaggregation of the real default model (SmolLM2) over HTTP: a gateway with a
prefill engine (kv_role producer) and a decode engine (kv_role consumer), two real engine
processes on loopback whose KV moves over TCP, driven by the gateway's two hops (gateway.dispatch.disagg)
as vLLM's proxy drives vLLM engines; the real openai client.

Greedy text of a disaggregated request is the text of the same request served by one engine
(the prefill engine alone), for a prompt of several chunks (64-token steps), with prefix caching
on both sides: the producer's own cache, the consumer's cache of blocks it read before, and a
prompt whose first blocks the consumer holds and whose rest it reads. fp32 here, fp8 KV in the
slow tier. Forged params recompute (or are a 400 when malformed), never read foreign KV. A
prefill's held blocks that no decode engine will read (the client left, every decode attempt
failed) are released by the gateway at once, far under kv_hold_timeout_s (300 s here).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time
import uuid

import httpx
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families
from pydoc_data.topics import topics

from gateway.backend import GenerationRequest, SamplingParams
from gateway.errors import BackendError, InvalidRequestError
from tests.support.servers.loopback import GatewayServer, native_gateway

pytestmark = pytest.mark.timeout(900)  # engines load the real model

MAX_TOKENS = 12
TEXT = " ".join(" ".join(topics[name].split()) for name in ("for", "while", "if", "try"))
PROMPT_A = TEXT[:1400]  # ~300 tokens: five 64-token chunks
PROMPT_B = TEXT[:700] + TEXT[3000:3700]  # shares PROMPT_A's first blocks, then ~150 tokens of its own


def config(kv_cache_dtype: str) -> str:
    settings = (f"{{kv_role: {{role}}, kv_cache_dtype: {kv_cache_dtype}, kv_cache_bytes: 67108864, "
                "max_num_batched_tokens: 64, max_num_seqs: 4, num_threads: 1, kv_hold_timeout_s: 300}")
    return f"""
models:
  - name: smollm2
    deployments:
      - name: prefill
        backend: native
        role: prefill
        settings: {settings.replace("{role}", "producer")}
      - name: decode
        backend: native
        role: decode
        settings: {settings.replace("{role}", "consumer")}
"""


@pytest.fixture(scope="module")
def gw_fp32(tmp_path_factory):
    os.environ.setdefault("KVGATE_CACHE_DIR", str(tmp_path_factory.mktemp("kvgate-cache")))
    exporter = InMemorySpanExporter()
    with GatewayServer(config("float32"), ready_timeout=600, span_exporter=exporter) as server:
        server.exporter = exporter
        yield server


@pytest.fixture(scope="module")
def gw_fp8(tmp_path_factory):
    with native_gateway(config("fp8_e4m3"), tmp_path_factory) as server:
        yield server


def events_of(gw, deployment: str, prompt: str, extra: dict | None = None, max_tokens: int = MAX_TOKENS) -> list:
    """The token events of greedy `prompt` on `deployment`'s engine alone (its plugin, no hops)."""
    request = GenerationRequest(request_id=uuid.uuid4().hex, model="smollm2", prompt=prompt, extra=extra or {},
                                sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0))

    async def collect() -> list:
        return [event async for event in gw.backend(deployment).generate(request)]

    return asyncio.run_coroutine_threadsafe(collect(), gw.loop).result(timeout=300)


def on_one_engine(gw, deployment: str, prompt: str, extra: dict | None = None) -> str:
    return "".join(event.text for event in events_of(gw, deployment, prompt, extra))


def disaggregated(gw, prompt: str) -> str:
    answer = gw.openai(timeout=300).completions.create(model="smollm2", prompt=prompt, max_tokens=MAX_TOKENS,
                                                       temperature=0)
    assert answer.choices[0].finish_reason == "length"
    gw.prompt_tokens = answer.usage.prompt_tokens
    return answer.choices[0].text


def engine_stat(gw, deployment: str, key: str, at_least: float, timeout_s: float = 10) -> float:
    """An engine counter from its periodic stats, once it reaches `at_least` (they lag a step)."""
    deadline = time.monotonic() + timeout_s
    while (value := gw.backend(deployment).load().extra.get(key, 0.0)) < at_least and time.monotonic() < deadline:
        time.sleep(0.05)
    return value


def check_exact_with_prefix_caching(gw) -> None:
    # A: one engine first (from scratch, five chunks); then the two hops, the producer from its cache.
    expected_a = on_one_engine(gw, "prefill", PROMPT_A)
    assert disaggregated(gw, PROMPT_A) == expected_a
    assert engine_stat(gw, "decode", "kv_transfers", 1) == 1
    transferred = engine_stat(gw, "decode", "kv_transfer_tokens", 1)
    gw.prompt_a_tokens, gw.read_for_a = gw.prompt_tokens, transferred
    assert transferred >= 256  # all of the prompt's full blocks but the last token's
    # A again: the consumer holds the blocks it read; nothing more to read.
    assert disaggregated(gw, PROMPT_A) == expected_a
    # B: the two hops first (the producer from scratch past the shared blocks); the consumer holds
    # the shared blocks and reads the rest.
    got_b = disaggregated(gw, PROMPT_B)
    assert got_b == on_one_engine(gw, "prefill", PROMPT_B)
    assert engine_stat(gw, "decode", "kv_transfers", 2) == 2
    read_for_b = engine_stat(gw, "decode", "kv_transfer_tokens", transferred + 1) - transferred
    assert 64 <= read_for_b < transferred  # its own blocks only: the shared ones were cached
    assert gw.backend("decode").load().extra["kv_transfer_failures"] == 0


def test_disaggregated_greedy_text_is_one_engines_fp32(gw_fp32):
    gw_fp32.exporter.clear()
    check_exact_with_prefix_caching(gw_fp32)
    # The decode hops' traces show the read of the prompt's KV, under the decode attempt.
    spans = gw_fp32.exporter.get_finished_spans()
    reads = [s for s in spans if s.name == "engine.kv_transfer"]
    assert len(reads) == 2 and all(s.attributes["kvgate.engine.kv_transfer_tokens"] > 0 for s in reads)
    hops = {s.context.span_id: s.attributes.get("kvgate.pd.hop") for s in spans}
    assert {hops[s.parent.span_id] for s in reads} == {"decode"}
    # ... and that the decode engine used what it read: it computed only the prompt's last tokens
    # (a read thrown away would recompute all ~300). A's first hop read `transferred` of its tokens.
    computed = [s.attributes["kvgate.engine.computed_prompt_tokens"] for s in spans
                if s.name == "engine.prefill" and hops.get(s.parent.span_id) == "decode"]
    assert len(computed) == 3 and computed[0] == gw_fp32.prompt_a_tokens - gw_fp32.read_for_a
    assert all(1 <= n <= 16 for n in computed), computed  # one 16-token block at most, each of the three
    samples = {(s.name, s.labels.get("deployment")): s.value for family in text_string_to_metric_families(
        httpx.get(gw_fp32.base_url + "/metrics", timeout=30).text) for s in family.samples}
    assert samples["kvgate_engine_kv_transfer_bytes_count", "decode"] == 2
    assert samples["kvgate_engine_kv_transfer_seconds_count", "decode"] == 2
    assert samples["kvgate_engine_kv_transfers_served_total", "prefill"] >= 2


@pytest.mark.slow
def test_disaggregated_greedy_text_is_one_engines_fp8(gw_fp8):
    check_exact_with_prefix_caching(gw_fp8)


def test_forged_params_make_the_decode_engine_recompute_or_refuse(gw_fp32):
    prompt = TEXT[2000:2800]
    expected = on_one_engine(gw_fp32, "prefill", prompt)
    params = events_of(gw_fp32, "prefill", prompt, {"kv_transfer_params": {"do_remote_decode": True}}, 1)[-1] \
        .kv_transfer_params  # a real hold on the producer, for someone else
    failures = engine_stat(gw_fp32, "decode", "kv_transfer_failures", 0)
    refused = engine_stat(gw_fp32, "prefill", "kv_transfers_refused", 0)
    # Another engine's id (a restarted producer's params look the same): refused there, recomputed here.
    forged = {**params, "remote_engine_id": "0" * 32}
    assert on_one_engine(gw_fp32, "decode", prompt, {"kv_transfer_params": forged}) == expected
    assert engine_stat(gw_fp32, "decode", "kv_transfer_failures", failures + 1) == failures + 1
    assert engine_stat(gw_fp32, "prefill", "kv_transfers_refused", refused + 1) == refused + 1
    with pytest.raises(InvalidRequestError, match="remote_block_ids"):
        on_one_engine(gw_fp32, "decode", prompt, {"kv_transfer_params": {**params, "remote_block_ids": "all"}})
    # Nobody else reads that hold: freed now (the module's hold timeout outlasts the tests after this).
    asyncio.run_coroutine_threadsafe(gw_fp32.backend("prefill").release_kv(params), gw_fp32.loop).result(timeout=30)


def test_client_transfer_params_never_reach_an_engine(gw_fp32):
    """The gateway drops kv_transfer_params a client sends: only its own hops carry them."""
    client = gw_fp32.openai(timeout=300)
    forged = {"do_remote_prefill": True, "remote_engine_id": "x", "remote_request_id": "y",
              "remote_block_ids": "not even a list", "remote_host": "127.0.0.1", "remote_port": 1}
    answer = client.completions.create(model="smollm2", prompt=PROMPT_A[:600], max_tokens=2, temperature=0,
                                       extra_body={"kv_transfer_params": forged})
    assert answer.choices[0].text


def wait_for(condition, timeout_s: float = 10) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return condition()


def prefill_stats(gw) -> dict:
    return gw.backend("prefill").load().extra


def blocks_held(gw, timeout_s: float = 300) -> dict:
    """The prefill engine's stats once they show blocks held: a snapshot taken after the hop that
    holds them, so its counters include every release sent before that hop (they lag a step)."""
    assert wait_for(lambda: prefill_stats(gw)["kv_blocks_held"] > 0, timeout_s)
    return prefill_stats(gw)


async def never_answers(request):
    """A decode deployment that takes the hop and sends nothing (until the gateway cancels it)."""
    await asyncio.Event().wait()
    yield


def test_a_client_that_leaves_after_the_prefill_hop_frees_the_prefill_engines_blocks(gw_fp32, monkeypatch):
    assert wait_for(lambda: prefill_stats(gw_fp32)["kv_blocks_held"] == 0)  # the earlier tests' holds are gone
    monkeypatch.setattr(gw_fp32.backend("decode"), "generate", never_answers)
    body = json.dumps({"model": "smollm2", "prompt": TEXT[4000:4800], "max_tokens": 4, "stream": True}).encode()
    with socket.create_connection(("127.0.0.1", gw_fp32.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        held = blocks_held(gw_fp32)  # the prefill hop ended; the decode hop waits: the client leaves
    assert wait_for(lambda: prefill_stats(gw_fp32)["kv_blocks_held"] == 0)
    assert prefill_stats(gw_fp32)["kv_holds_released"] == held["kv_holds_released"] + 1
    assert prefill_stats(gw_fp32)["kv_holds_expired"] == held["kv_holds_expired"]  # released, not timed out


def test_a_decode_pool_that_fails_every_attempt_frees_the_prefill_engines_blocks(gw_fp32, monkeypatch):
    assert wait_for(lambda: prefill_stats(gw_fp32)["kv_blocks_held"] == 0)
    held = []

    async def fails_once_the_blocks_are_held(request):
        """A decode deployment that fails every hop before its first token."""
        held.append(await asyncio.to_thread(blocks_held, gw_fp32, 30))
        raise BackendError("this decode engine is down (the test says so)")
        yield

    monkeypatch.setattr(gw_fp32.backend("decode"), "generate", fails_once_the_blocks_are_held)
    answer = httpx.post(gw_fp32.base_url + "/v1/completions", timeout=300,
                        json={"model": "smollm2", "prompt": TEXT[5000:5800], "max_tokens": 4})
    assert answer.status_code >= 500, answer.text
    assert len(held) == 1  # the one decode deployment, tried once, with the prefill's blocks held
    assert wait_for(lambda: prefill_stats(gw_fp32)["kv_blocks_held"] == 0)
    assert prefill_stats(gw_fp32)["kv_holds_released"] == held[0]["kv_holds_released"] + 1
    assert prefill_stats(gw_fp32)["kv_transfers_served"] == held[0]["kv_transfers_served"]  # none read
