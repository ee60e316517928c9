"""/v1/embeddings, /tokenize and /detokenize: through the echo backend and, with the openai
backend, an upstream that serves them (tests/support/fakes/scripted_upstream.py); routed, limited, traced
and metered like completions."""

from __future__ import annotations

import math

import httpx
import openai
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tests.support.fakes.scripted_upstream import ScriptedUpstream, vector_of
from tests.support.servers.loopback import GatewayServer

CONFIG = """
server:
  limits: {{max_embedding_inputs: 3, max_embedding_input_chars: 100, max_prompt_tokens: 50}}
auth:
  keys:
    - {{name: tight, key: sk-tight-0001, requests_per_minute: 2}}
    - {{name: tokens, key: sk-tokens-0001, tokens_per_minute: 5}}
    - {{name: open, key: sk-open-00001, scopes: [metrics]}}
models:
  - name: echo
    deployments: [{{name: echo-0, backend: echo}}]
  - name: scripted
    deployments:
      - name: dead-0
        backend: openai
        settings: {{base_url: "http://127.0.0.1:{dead}/v1", server: kvgate, metrics: none, connect_s: 1}}
      - name: vllm-0
        backend: openai
        settings: {{base_url: "{base}/v1", server: kvgate, metrics: none}}
  - name: chat-only
    deployments:
      - name: trt-0
        backend: openai
        settings: {{base_url: "{base}/v1", server: trtllm, metrics: none}}
"""


@pytest.fixture(scope="module")
def exporter():
    return InMemorySpanExporter()


@pytest.fixture(scope="module")
def gw(scripted_upstream, exporter):
    from tests.support.servers.loopback import free_port

    config = CONFIG.format(base=scripted_upstream.base_url, dead=free_port())
    with GatewayServer(config, span_exporter=exporter) as server:
        yield server


def client(gw, key="sk-open-00001"):
    return openai.OpenAI(base_url=gw.base_url + "/v1", api_key=key, max_retries=0, timeout=30)


def post(gw, path, body, key="sk-open-00001"):
    return httpx.post(gw.base_url + path, json=body, headers={"authorization": f"Bearer {key}"}, timeout=30)


def test_embeddings_through_the_openai_client_are_unit_vectors_in_order(gw):
    # The client asks for base64 unless told otherwise, and decodes it as float32.
    out = client(gw).embeddings.create(model="echo", input=["one two", "three", "one two"])
    vectors = [d.embedding for d in out.data]
    assert [d.index for d in out.data] == [0, 1, 2] and len(vectors[0]) == 16
    assert all(abs(math.sqrt(sum(x * x for x in v)) - 1) < 1e-5 for v in vectors)
    assert vectors[0] == vectors[2] and vectors[0] != vectors[1]
    assert out.usage.prompt_tokens == 5 and out.model == "echo"
    floats = post(gw, "/v1/embeddings", {"model": "echo", "input": "one two", "encoding_format": "float"}).json()
    assert [round(x, 5) for x in floats["data"][0]["embedding"]] == [round(x, 5) for x in vectors[0]]


def test_embeddings_of_token_arrays_and_dimensions(gw):
    out = client(gw).embeddings.create(model="echo", input=[[1, 2, 3], [4]], dimensions=5)
    assert [len(d.embedding) for d in out.data] == [5, 5] and out.usage.prompt_tokens == 4


def test_embeddings_through_an_upstream_fail_over_a_dead_deployment(gw, scripted_upstream):
    dead = next(d for d in gw.state.registry.deployments() if d.name == "dead-0")
    for _ in range(2):  # equal deployments take turns: one of these goes to dead-0 first
        out = client(gw).embeddings.create(model="scripted", input=["red apples", "green pears"], dimensions=6)
        for row, text in zip(out.data, ["red apples", "green pears"]):
            assert [round(x, 5) for x in row.embedding] == [round(x, 5) for x in vector_of(text, 6)]
    assert scripted_upstream.bodies("/v1/embeddings")[-1]["encoding_format"] == "float"
    assert dead.breaker.consecutive_failures >= 1 and dead.in_flight == 0


def test_tokenize_and_detokenize_round_trip_on_echo(gw):
    tokens = post(gw, "/tokenize", {"model": "echo", "prompt": "alpha beta gamma", "return_token_strs": True}).json()
    assert tokens["count"] == 4 and tokens["token_strs"] == ["<s>", "alpha", "beta", "gamma"]
    assert tokens["max_model_len"] == 4096
    text = post(gw, "/detokenize", {"model": "echo", "tokens": tokens["tokens"][1:]}).json()
    assert text == {"prompt": "alpha beta gamma"}
    chat = post(gw, "/tokenize", {"model": "echo", "messages": [{"role": "user", "content": "alpha beta"}]}).json()
    assert chat["tokens"] == tokens["tokens"][1:3]  # the chat form adds no BOS unless asked


def test_tokenize_through_an_upstream_in_vllms_shape(gw, scripted_upstream):
    body = {"model": "scripted", "messages": [{"role": "user", "content": "hello there"}],
            "add_generation_prompt": True}
    tokens = post(gw, "/tokenize", body).json()
    assert tokens["count"] == 2 and tokens["max_model_len"] == scripted_upstream.max_model_len
    sent = scripted_upstream.bodies("/tokenize")[-1]
    assert sent["messages"] == body["messages"] and sent["add_generation_prompt"] is True
    assert post(gw, "/detokenize", {"model": "scripted", "tokens": tokens["tokens"]}).json() == {"prompt": "hello there"}


@pytest.mark.parametrize("path, body, param", [
    ("/v1/embeddings", {"model": "echo", "input": ["a", "b", "c", "d"]}, "input"),
    ("/v1/embeddings", {"model": "echo", "input": ["a", ""]}, "input[1]"),
    ("/v1/embeddings", {"model": "echo", "input": ""}, "input"),
    ("/v1/embeddings", {"model": "echo", "input": []}, "input"),
    ("/v1/embeddings", {"model": "echo", "input": "x" * 101}, "input"),
    ("/v1/embeddings", {"model": "echo", "input": [list(range(30)), list(range(30))]}, "input"),
    ("/v1/embeddings", {"model": "echo", "input": "a", "encoding_format": "int8"}, "encoding_format"),
    ("/v1/embeddings", {"model": "echo", "input": "a", "dimensions": 0}, "dimensions"),
    ("/v1/embeddings", {"model": "chat-only", "input": "a"}, "model"),
    ("/v1/embeddings", {"model": "echo", "input": "a", "truncate_prompt_tokens": 3}, "truncate_prompt_tokens"),
    ("/tokenize", {"model": "echo", "messages": [{"role": "user", "content": "a"}], "chat_template": "{{x}}"},
     "chat_template"),
    ("/tokenize", {"model": "echo", "messages": [{"role": "user", "content": "a"}], "continue_final_message": True},
     None),
    ("/tokenize", {"model": "echo", "prompt": "a", "messages": []}, "prompt"),
    ("/tokenize", {"prompt": "a"}, "model"),
    ("/tokenize", {"model": "chat-only", "prompt": "a"}, "model"),
    ("/detokenize", {"model": "echo", "tokens": [-1]}, "tokens[0]"),
    ("/detokenize", {"model": "echo", "tokens": list(range(51))}, "tokens"),
])
def test_bad_input_is_a_400_naming_the_path(gw, path, body, param):
    r = post(gw, path, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    assert all(d.breaker.state == "closed" for d in gw.state.registry.deployments() if d.name != "dead-0")


def test_requests_per_minute_count_embeddings_and_tokenize(gw):
    assert post(gw, "/v1/embeddings", {"model": "echo", "input": "a"}, key="sk-tight-0001").status_code == 200
    assert post(gw, "/tokenize", {"model": "echo", "prompt": "a"}, key="sk-tight-0001").status_code == 200
    r = post(gw, "/detokenize", {"model": "echo", "tokens": [1]}, key="sk-tight-0001")
    assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"


def test_tokens_per_minute_count_embedded_tokens(gw):
    assert post(gw, "/v1/embeddings", {"model": "echo", "input": "one two three four five six"},
                key="sk-tokens-0001").status_code == 200
    assert post(gw, "/v1/embeddings", {"model": "echo", "input": "a"}, key="sk-tokens-0001").status_code == 429


def test_metered_and_traced_like_completions(gw, exporter):
    assert post(gw, "/v1/embeddings", {"model": "echo", "input": "traced words"}).status_code == 200
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert "embeddings echo" in spans
    assert spans["embeddings echo"].attributes["gen_ai.usage.input_tokens"] == 2
    metrics = httpx.get(gw.base_url + "/metrics", headers={"authorization": "Bearer sk-open-00001"}).text
    assert 'kvgate_requests_total{deployment="echo-0",model="echo",sla_class="standard",status="200"}' in metrics


def test_openapi_lists_the_new_endpoints(gw):
    paths = httpx.get(gw.base_url + "/openapi.json", headers={"authorization": "Bearer sk-open-00001"}).json()["paths"]
    assert {"/v1/embeddings", "/tokenize", "/detokenize"} <= set(paths)


def test_models_say_which_models_embed_and_tokenize(gw):
    cards = {m["id"]: m for m in httpx.get(gw.base_url + "/v1/models", timeout=10,
                                            headers={"authorization": "Bearer sk-open-00001"}).json()["data"]}
    assert {"embeddings", "tokenize"} <= set(cards["echo"]["capabilities"]["endpoints"])
    assert "embeddings" not in cards["chat-only"]["capabilities"]["endpoints"]
    assert "tools" not in cards["chat-only"]["capabilities"]["features"]
    assert "tools" in cards["scripted"]["capabilities"]["features"]
