"""What the benchmark clients users measure servers with need from kvgate: GuideLLM 0.8.1 and
`vllm bench serve` (read from their sources; bench/GUIDELLM.md lists the fields).

- before any load, `GET /health` (200 when it can serve, 503 otherwise) and `/v1/models`, whose
  entries carry vLLM's `root` and `max_model_len`; `GET /version`;
- their request bodies, field for field, are answered 200;
- `stream_options.continuous_usage_stats` (GuideLLM sends it): usage in every chunk, the counts
  so far, then the totals in the usage chunk.
"""

import json

import httpx
import pytest

import gateway
from tests.support.servers.loopback import GatewayServer

CONFIG = """
models:
  - name: echo
    deployments:
      - {name: echo-0, backend: echo, settings: {max_context: 1000}}
  - name: other
    deployments:
      - {name: other-0, backend: echo}
"""
PROMPT = "one two three four five six"
# GuideLLM 0.8.1's bodies (backends/openai/request_handlers.py) with fixed output lengths: it sets
# stop null and drops nulls before sending; user content is a list of text parts.
GUIDELLM_CHAT = {"model": "echo", "stream": True,
                 "stream_options": {"include_usage": True, "continuous_usage_stats": True},
                 "max_completion_tokens": 5, "ignore_eos": True,
                 "messages": [{"role": "user", "content": [{"type": "text", "text": PROMPT}]}]}
GUIDELLM_COMPLETIONS = {"model": "echo", "stream": True,
                        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
                        "max_tokens": 5, "ignore_eos": True, "prompt": PROMPT}
# `vllm bench serve`'s (benchmarks/lib/endpoint_request_func.py): greedy unless told, logprobs
# null, repetition_penalty 1.0 on completions, ignore_eos with --ignore-eos, an x-request-id.
VLLM_COMPLETIONS = {"model": "echo", "prompt": PROMPT, "repetition_penalty": 1.0, "max_tokens": 5,
                    "logprobs": None, "stream": True, "stream_options": {"include_usage": True},
                    "ignore_eos": True, "temperature": 0.0}
VLLM_CHAT = {"model": "echo", "messages": [{"role": "user", "content": [{"type": "text", "text": PROMPT}]}],
             "max_completion_tokens": 5, "stream": True, "stream_options": {"include_usage": True},
             "ignore_eos": True, "temperature": 0.0}


@pytest.fixture(scope="module")
def gw():
    server = GatewayServer(CONFIG)
    yield server
    server.close()


def _events(gw, path: str, body: dict, headers=None) -> list[dict]:
    r = httpx.post(gw.base_url + path, json=body, headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    lines = [line.removeprefix("data: ") for line in r.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_health_and_version_answer_as_vllm_without_a_key(gw):
    assert httpx.get(gw.base_url + "/health").status_code == 200
    assert httpx.get(gw.base_url + "/version").json() == {"version": gateway.__version__}


def test_health_is_503_naming_a_model_none_of_whose_deployments_is_up():
    config = CONFIG.replace("{name: other-0, backend: echo}",
                            "{name: other-0, backend: echo, settings: {refuse_at_start: true}}")
    with GatewayServer(config) as server:
        r = httpx.get(server.base_url + "/health")
        assert r.status_code == 503
        assert r.json()["models_down"] == ["other"]


def test_health_and_version_need_no_key_where_keys_are_configured(monkeypatch):
    monkeypatch.setenv("TEST_BENCH_KEY", "sk-bench-test-key")
    config = CONFIG + "auth:\n  keys:\n    - {name: k, key_env: TEST_BENCH_KEY}\n"
    with GatewayServer(config) as server:
        assert httpx.get(server.base_url + "/v1/models").status_code == 401
        assert httpx.get(server.base_url + "/health").status_code == 200
        assert httpx.get(server.base_url + "/version").status_code == 200


def test_models_carry_root_and_max_model_len_as_vllm(gw):
    data = {m["id"]: m for m in httpx.get(gw.base_url + "/v1/models").json()["data"]}
    assert data["echo"]["max_model_len"] == 1000  # the deployment's context length
    assert data["other"]["max_model_len"] == 4096  # echo's default
    assert data["echo"]["root"] == "echo" and data["echo"]["parent"] is None


@pytest.mark.parametrize("path, body", [("/v1/chat/completions", GUIDELLM_CHAT),
                                        ("/v1/completions", GUIDELLM_COMPLETIONS)], ids=["chat", "completions"])
def test_guidellm_bodies_get_usage_in_every_chunk(gw, path, body):
    chunks = _events(gw, path, body)
    assert all("usage" in c for c in chunks)
    # The echo backend's prompt is 6 words: 6 prompt tokens, and one more output token a chunk.
    text_chunks = [c for c in chunks if c["choices"] and _text(c["choices"][0])]
    assert [c["usage"]["completion_tokens"] for c in text_chunks] == [1, 2, 3, 4, 5]
    assert {c["usage"]["prompt_tokens"] for c in chunks} == {6}
    assert all(c["usage"]["total_tokens"] == c["usage"]["prompt_tokens"] + c["usage"]["completion_tokens"]
               for c in chunks)
    last = chunks[-1]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 5


def _text(choice: dict) -> str:
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


def test_chat_role_opener_carries_the_prompt_tokens_and_no_output(gw):
    opener = _events(gw, "/v1/chat/completions", GUIDELLM_CHAT)[0]
    assert opener["choices"][0]["delta"]["role"] == "assistant"
    assert opener["usage"] == {"prompt_tokens": 6, "completion_tokens": 0, "total_tokens": 6}


def test_continuous_usage_counts_each_choice_of_n_on_its_own(gw):
    chunks = _events(gw, "/v1/completions", {**GUIDELLM_COMPLETIONS, "n": 2, "max_tokens": 3})
    for index in (0, 1):
        counts = [c["usage"]["completion_tokens"] for c in chunks if c["choices"] and c["choices"][0]["index"] == index]
        assert counts == [1, 2, 3]
    assert chunks[-1]["usage"]["completion_tokens"] == 6  # both choices, in the final usage chunk


def test_continuous_usage_without_include_usage_sends_none_as_vllm(gw):
    body = {**GUIDELLM_COMPLETIONS, "stream_options": {"continuous_usage_stats": True}}
    assert not any("usage" in c for c in _events(gw, "/v1/completions", body))


def test_a_wrong_type_of_continuous_usage_stats_is_named(gw):
    body = {**GUIDELLM_COMPLETIONS, "stream_options": {"include_usage": True, "continuous_usage_stats": "yes"}}
    r = httpx.post(gw.base_url + "/v1/completions", json=body)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "stream_options.continuous_usage_stats"


@pytest.mark.parametrize("path, body", [("/v1/completions", VLLM_COMPLETIONS),
                                        ("/v1/chat/completions", VLLM_CHAT)], ids=["completions", "chat"])
def test_vllm_bench_serve_bodies_are_served_with_usage_at_the_end(gw, path, body):
    chunks = _events(gw, path, body, headers={"x-request-id": "bench-0"})
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
    assert not any("usage" in c for c in chunks[:-1])  # no continuous stats unless asked
