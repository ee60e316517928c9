"""Prefill/decode disaggregation through kvgate to vLLM engines (issue 30 items 3, 4, 8): the real
`openai` client against kvgate, whose `openai` deployments are loopback engines that speak vLLM's
P/D protocol as its NIXL connector does (`VllmPDEngine`). Each test checks what every engine
received and what the client saw."""

from __future__ import annotations

import contextlib
import time

import httpx
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from tests.support.fakes.vllm_pd import VLLM_PREFILL_PARAMS, VllmPDEngine, prompt_of
from tests.support.servers.loopback import GatewayServer

MIN_PROMPT_CHARS = 20
LONG = "please repeat these words back to me exactly"
ASK = [{"role": "user", "content": LONG}]


ENGINE = "{{name: {name}, backend: openai, role: {role}, upstream_model: scripted, " \
         "settings: {{base_url: '{base}/v1', server: vllm, metrics: none}}}}"
CONFIG = """
models:
  - name: pd
    disaggregation: {{min_prompt_chars: {min_chars}}}
    breaker: {{failures: 100}}
    deployments:
{engines}
  - name: plain
    deployments:
      - {{name: solo, backend: openai, upstream_model: scripted, settings: {{base_url: '{solo}/v1', server: vllm, metrics: none}}}}
"""
ROLES = {"P0": "prefill", "P1": "prefill", "D0": "decode", "D1": "decode"}


@pytest.fixture(scope="module")
def engines():
    cluster: dict = {}
    started = {name: VllmPDEngine(name, cluster) for name in [*ROLES, "solo"]}
    yield started
    for engine in started.values():
        engine.close()


@pytest.fixture()
def gw(engines):
    for engine in engines.values():
        engine.reset()
    listed = "\n".join("      - " + ENGINE.format(name=n, role=r, base=engines[n].base_url) for n, r in ROLES.items())
    exporter = InMemorySpanExporter()
    config = CONFIG.format(min_chars=MIN_PROMPT_CHARS, engines=listed, solo=engines["solo"].base_url)
    with GatewayServer(config, span_exporter=exporter) as server:
        server.spans = exporter
        yield server


def prefills(engines) -> list[dict]:
    return [b for n in ("P0", "P1") for b in engines[n].bodies("/v1/chat/completions")]


def decodes(engines) -> list[dict]:
    return [b for n in ("D0", "D1") for b in engines[n].bodies("/v1/chat/completions")]


def loaded(engines) -> list[tuple[str, str]]:
    return engines["D0"].loaded + engines["D1"].loaded


def metric(gw, name: str, **labels) -> float:
    """The value of the series of `name` with these labels (0 when it has not been counted)."""
    text = httpx.get(gw.base_url + "/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_stream_is_prefilled_on_one_engine_and_decoded_on_another(gw, engines):
    stream = gw.openai(timeout=30).chat.completions.create(model="pd", messages=ASK, max_tokens=50, stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == LONG
    assert len({c.id for c in chunks}) == 1
    request_id = chunks[0].id
    [prefill], [decode] = prefills(engines), decodes(engines)
    # The prefill hop, as vLLM's proxy sends it.
    assert prefill["kv_transfer_params"] == VLLM_PREFILL_PARAMS
    assert prefill["max_tokens"] == 1 and prefill["stream"] is False and "stream_options" not in prefill
    assert prefill["messages"] == ASK
    # The decode hop: the client's request plus what the prefill engine returned; it read the KV.
    params = decode["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["remote_request_id"] == request_id
    assert decode["stream"] is True and decode["max_tokens"] == 50
    assert loaded(engines) == [(params["remote_engine_id"], request_id)]
    # One id across both hops, as the engines saw it.
    assert [i for n in ROLES for i in engines[n].request_ids] == [request_id, request_id]
    assert metric(gw, "kvgate_pd_hops_total", model="pd", pool="prefill", outcome="ok") == 1
    assert metric(gw, "kvgate_pd_hops_total", model="pd", pool="decode", outcome="ok") == 1
    assert metric(gw, "kvgate_pd_hop_seconds_count", model="pd", pool="prefill") == 1


def test_both_hops_are_spans_of_the_request_trace(gw, engines):
    answer = gw.openai(timeout=30).chat.completions.create(model="pd", messages=ASK, max_tokens=50)
    assert answer.choices[0].message.content == LONG and answer.choices[0].finish_reason == "stop"
    spans = gw.spans.get_finished_spans()
    [root] = [s for s in spans if s.kind == SpanKind.SERVER]
    hops = {s.attributes["kvgate.pd.hop"]: s for s in spans if s.kind == SpanKind.CLIENT}
    assert set(hops) == {"prefill", "decode"}
    assert all(s.context.trace_id == root.context.trace_id and s.parent.span_id == root.context.span_id
               for s in hops.values())
    assert hops["prefill"].end_time <= hops["decode"].start_time
    assert hops["decode"].attributes["kvgate.pd.remote_kv"] is True
    assert hops["prefill"].attributes["kvgate.deployment"] in ("P0", "P1")
    assert hops["decode"].attributes["kvgate.deployment"] in ("D0", "D1")
    # Each hop's routing decision, among its own pool's deployments.
    routes = [s.attributes for s in spans if s.name == "kvgate.route"]
    assert [(r.get("kvgate.pd.hop"), tuple(r["kvgate.candidates"])) for r in routes] == [
        ("prefill", ("P0", "P1")), (None, ("D0", "D1"))]


def test_a_failed_prefill_moves_to_another_prefill_deployment(gw, engines):
    engines["P0"].fail = 100
    client = gw.openai(timeout=30)
    for _ in range(4):  # the deployments take turns: P0 is tried, and fails, at least once
        assert client.chat.completions.create(model="pd", messages=ASK, max_tokens=50).choices[0].message.content == LONG
    assert engines["P0"].request_ids, "P0 was never tried"
    assert [engine for engine, _ in loaded(engines)] == ["P1"] * 4
    assert metric(gw, "kvgate_pd_hops_total", model="pd", pool="prefill", outcome="failed") == len(engines["P0"].request_ids)


def test_no_healthy_prefill_means_the_decode_pool_serves_colocated(gw, engines):
    engines["P0"].fail = engines["P1"].fail = 100
    answer = gw.openai(timeout=30).chat.completions.create(model="pd", messages=ASK, max_tokens=50)
    assert answer.choices[0].message.content == LONG
    [decode] = decodes(engines)
    assert "kv_transfer_params" not in decode
    assert engines["D0"].computed + engines["D1"].computed == 1
    assert metric(gw, "kvgate_pd_colocated_total", model="pd", reason="no_prefill") == 1


def test_a_decode_that_fails_before_its_first_token_moves_to_another_decode(gw, engines):
    engines["D0"].fail = 100
    client = gw.openai(timeout=30)
    for _ in range(3):
        stream = client.chat.completions.create(model="pd", messages=ASK, max_tokens=50, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == LONG
    assert engines["D0"].request_ids, "D0 was never tried"
    # Each retried decode carried the prefill's params, and D1 read the KV every time.
    assert len(engines["D1"].loaded) == 3 and engines["D1"].recomputed == 0
    assert len(prefills(engines)) == 3  # the prefill is not repeated for a decode retry


def test_short_prompts_skip_the_prefill_hop(gw, engines):
    answer = gw.openai(timeout=30).chat.completions.create(
        model="pd", messages=[{"role": "user", "content": "hi there"}], max_tokens=5)
    assert answer.choices[0].message.content == "hi there"
    assert prefills(engines) == [] and "kv_transfer_params" not in decodes(engines)[0]
    assert metric(gw, "kvgate_pd_colocated_total", model="pd", reason="short_prompt") == 1


def test_a_prefill_that_stops_before_its_limit_returns_no_params(gw, engines):
    one_word = [{"role": "user", "content": "supercalifragilisticexpialidocious"}]
    answer = gw.openai(timeout=30).chat.completions.create(model="pd", messages=one_word, max_tokens=5)
    assert answer.choices[0].message.content == one_word[0]["content"]
    assert len(prefills(engines)) == 1 and "kv_transfer_params" not in decodes(engines)[0]
    assert metric(gw, "kvgate_pd_colocated_total", model="pd", reason="no_params") == 1


def test_transfer_params_from_clients_are_dropped(gw, engines):
    forged = {"do_remote_prefill": True, "remote_engine_id": "P0", "remote_request_id": "someone-else",
              "remote_block_ids": [7], "remote_host": "10.0.0.9", "remote_port": 5600}
    engines["P0"].held["someone-else"] = prompt_of({"messages": ASK})  # another request's blocks
    client = gw.openai(timeout=30)
    answer = client.chat.completions.create(model="pd", messages=ASK, max_tokens=50,
                                            extra_body={"kv_transfer_params": forged, "bootstrap_room": 7})
    assert answer.choices[0].message.content == LONG
    [prefill], [decode] = prefills(engines), decodes(engines)
    assert prefill["kv_transfer_params"] == VLLM_PREFILL_PARAMS and "bootstrap_room" not in prefill
    assert decode["kv_transfer_params"]["remote_request_id"] == answer.id != "someone-else"
    assert "someone-else" in engines["P0"].held  # never read
    # A colocated vLLM model neither forwards nor refuses them.
    plain = client.chat.completions.create(model="plain", messages=ASK, max_tokens=50,
                                           extra_body={"kv_transfer_params": forged})
    assert plain.choices[0].message.content == LONG
    [sent] = engines["solo"].bodies("/v1/chat/completions")
    assert "kv_transfer_params" not in sent and engines["solo"].request_ids == [None]


def test_a_prefill_answer_naming_another_host_is_not_forwarded(gw, engines):
    """The decode engine connects where the prefill's answer says: an answer naming a host that is
    none of the model's prefill deployments (here every one names 203.0.113.9, a documentation
    address) goes no further; the decode computes the prompt, counted (issue 40 item 2)."""
    engines["P0"].forged_host = engines["P1"].forged_host = "203.0.113.9"
    answer = gw.openai(timeout=30).chat.completions.create(model="pd", messages=ASK, max_tokens=50)
    assert answer.choices[0].message.content == LONG
    [prefill], [decode] = prefills(engines), decodes(engines)
    assert prefill["kv_transfer_params"] == VLLM_PREFILL_PARAMS
    assert "kv_transfer_params" not in decode
    assert loaded(engines) == [] and engines["D0"].computed + engines["D1"].computed == 1
    assert metric(gw, "kvgate_pd_colocated_total", model="pd", reason="unknown_producer") == 1


def test_a_request_the_prefill_refuses_is_refused_without_a_decode(gw, engines):
    engines["P0"].refuse = engines["P1"].refuse = True
    response = httpx.post(gw.base_url + "/v1/chat/completions", timeout=30,
                          json={"model": "pd", "messages": ASK, "max_tokens": 50})
    assert response.status_code == 400
    assert "maximum context length" in response.json()["error"]["message"]
    assert len(prefills(engines)) == 1 and decodes(engines) == []  # the request's fault: not retried


def test_a_client_that_leaves_during_the_prefill_frees_every_slot(gw, engines):
    engines["P0"].prefill_delay_s = engines["P1"].prefill_delay_s = 3.0
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(gw.base_url + "/v1/chat/completions", timeout=0.5,
                   json={"model": "pd", "messages": ASK, "max_tokens": 50})
    pool = gw.state.registry.resolve("pd")
    deadline = time.monotonic() + 1.5  # well before the prefill would have answered
    while pool.in_flight and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pool.in_flight == 0
    # The engine finishes the abandoned prefill and holds its blocks (a vLLM engine cannot be told
    # otherwise): waited for here, not by the clock, or on a loaded box its answer lands in the next
    # test (which found a prefill engine holding blocks). No decode hop follows it.
    deadline = time.monotonic() + 60
    while not any(engines[n].held for n in ("P0", "P1")) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)  # room for a decode hop the gateway should not send (a late one is missed, never a flake)
    assert len(prefills(engines)) == 1 and decodes(engines) == []


@pytest.fixture()
def gw_without_queue(engines):
    """The P/D model whose decode deployments take one request each and whose queue holds none."""
    for engine in engines.values():
        engine.reset()
    listed = "\n".join("      - " + ENGINE.format(name=n, role=r, base=engines[n].base_url) for n, r in ROLES.items())
    no_queue = "    queue: {{max_size: 0, max_in_flight_per_deployment: 1}}"
    config = CONFIG.replace("    breaker: {{failures: 100}}", "    breaker: {{failures: 100}}\n" + no_queue)
    with GatewayServer(config.format(min_chars=MIN_PROMPT_CHARS, engines=listed, solo=engines["solo"].base_url)) as gw:
        yield gw


def test_a_request_the_decode_pool_sheds_makes_no_prefill_hop(gw_without_queue, engines):
    """Admission to the decode pool comes before the prefill hop: a request the decode pool sheds
    (every decode deployment busy, the queue full) leaves no prefill engine holding its blocks
    until kv_hold_timeout_s (a vLLM engine's cannot be freed from outside)."""
    gw = gw_without_queue
    decode = [d for d in gw.state.registry.resolve("pd").deployments if d.role == "decode"]
    for deployment in decode:
        deployment.in_flight += 1  # busy with a stream of another client's
    try:
        response = httpx.post(gw.base_url + "/v1/chat/completions", timeout=30,
                              json={"model": "pd", "messages": ASK, "max_tokens": 50})
        assert response.status_code == 503 and "queue" in response.json()["error"]["message"]
        assert prefills(engines) == [] and decodes(engines) == []
        assert all(not engines[n].held for n in ("P0", "P1"))
    finally:
        for deployment in decode:
            deployment.in_flight -= 1
    # Room again: both hops as usual, and the decode slot claimed before the prefill is given back.
    answer = gw.openai(timeout=30).chat.completions.create(model="pd", messages=ASK, max_tokens=50)
    assert answer.choices[0].message.content == LONG and len(prefills(engines)) == len(loaded(engines)) == 1
    assert gw.state.registry.resolve("pd").in_flight == 0


def test_completions_and_the_status_page_of_a_disaggregated_model(gw, engines):
    answer = gw.openai(timeout=30).completions.create(model="pd", prompt=LONG, max_tokens=50)
    assert answer.choices[0].text == LONG
    [prefill] = [b for n in ("P0", "P1") for b in engines[n].bodies("/v1/completions")]
    [decode] = [b for n in ("D0", "D1") for b in engines[n].bodies("/v1/completions")]
    assert prefill["kv_transfer_params"] == VLLM_PREFILL_PARAMS and prefill["max_tokens"] == 1
    assert decode["kv_transfer_params"]["remote_request_id"] == answer.id
    status = httpx.get(gw.base_url + "/status.json", timeout=10).json()
    [model] = [m for m in status["models"] if m["name"] == "pd"]
    assert {d["name"]: d["role"] for d in model["deployments"]} == ROLES


def test_each_choice_of_n_takes_its_own_two_hops(gw, engines):
    answer = gw.openai(timeout=30).chat.completions.create(model="pd", messages=ASK, max_tokens=50, n=2)
    assert [c.message.content for c in answer.choices] == [LONG, LONG]
    choice_ids = {f"{answer.id}-0", f"{answer.id}-1"}
    assert {b["kv_transfer_params"]["remote_request_id"] for b in decodes(engines)} == choice_ids
    assert {request_id for _, request_id in loaded(engines)} == choice_ids and len(prefills(engines)) == 2


POD = """
auth:
  keys:
    - {{name: gateway, key_env: POD_GATEWAY_KEY, scopes: [{scopes}]}}
models:
  - name: scripted
    deployments:
      - {{name: vllm, backend: openai, upstream_model: scripted, settings: {{base_url: '{base}/v1', server: vllm, metrics: none}}}}
"""
FRONT_ENGINE = "{{name: {name}, backend: openai, role: {role}, upstream_model: scripted, " \
               "settings: {{base_url: '{base}/v1', metrics: none, api_key_env: POD_GATEWAY_KEY}}}}"


@pytest.mark.parametrize("scopes", ["kv_transfer", "metrics"])
def test_a_kvgate_engine_server_passes_transfer_params_only_for_a_key_with_the_kv_transfer_scope(
        engines, monkeypatch, scopes):
    """A gateway whose P/D deployments are other kvgate servers (a Kubernetes engine pod each),
    each in front of one engine: the pods carry the params both ways for the gateway's key with
    scope kv_transfer; for any other key they drop them, so the decode engine computes the prompt."""
    for engine in engines.values():
        engine.reset()
    monkeypatch.setenv("POD_GATEWAY_KEY", "gateway-key-123456")
    with contextlib.ExitStack() as stack:
        pods = {n: stack.enter_context(GatewayServer(POD.format(scopes=scopes, base=engines[n].base_url)))
                for n in ("P0", "D0")}
        front = CONFIG.format(min_chars=MIN_PROMPT_CHARS, solo=engines["solo"].base_url, engines="\n".join(
            "      - " + FRONT_ENGINE.format(name=n, role=ROLES[n], base=pods[n].base_url) for n in pods))
        gw = stack.enter_context(GatewayServer(front))
        answer = gw.openai(timeout=30).chat.completions.create(model="pd", messages=ASK, max_tokens=50)
    assert answer.choices[0].message.content == LONG
    [prefill], [decode] = engines["P0"].bodies("/v1/chat/completions"), engines["D0"].bodies("/v1/chat/completions")
    assert prefill["max_tokens"] == 1
    if scopes == "kv_transfer":
        assert prefill["kv_transfer_params"] == VLLM_PREFILL_PARAMS
        assert decode["kv_transfer_params"]["remote_engine_id"] == "P0"
        assert [engine for engine, _ in engines["D0"].loaded] == ["P0"]
    else:
        assert "kv_transfer_params" not in prefill and "kv_transfer_params" not in decode
        assert engines["D0"].loaded == [] and engines["D0"].computed == 1
