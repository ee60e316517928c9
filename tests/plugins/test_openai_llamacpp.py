"""Slow tier: kvgate's openai backend in front of a real third-party server, llama.cpp.

Needs llama-cpp-python built by `bash bench/llamacpp_server.sh install` (about 6 minutes on
2 cores); skipped, saying so, when that build is absent (a failure where KVGATE_REQUIRE_LLAMACPP
is set, as .ci/run sets it). Greedy decoding makes llama.cpp's answer
deterministic, so the answer through kvgate must equal the answer from llama.cpp directly.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import tempfile
from pathlib import Path

import httpx
import openai
import pytest

from tests.support.servers.loopback import GatewayServer, listening_url, wait_ready
from tests.support.checks.skips import required

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "llamacpp_server.sh"

FRONT = """
models:
  - name: smol
    deployments:
      - name: llamacpp-0
        backend: openai
        upstream_model: smollm2
        settings:
          base_url: {base}/v1
          metrics: none
          first_byte_s: 120
"""


@pytest.fixture(scope="module")
def llamacpp():
    with llamacpp_server("serve") as base:
        yield base


@contextlib.contextmanager
def llamacpp_server(mode: str):
    """The script's `mode` (serve, serve-features) on a port it binds itself (port 0): its base
    URL, read from the line its uvicorn logs once it listens, when it serves the models."""
    python = subprocess.run(["bash", str(SCRIPT), "python"], capture_output=True, text=True).stdout.strip()
    if not python:
        required("KVGATE_REQUIRE_LLAMACPP",
                 "llama-cpp-python is not built: run `bash bench/llamacpp_server.sh install` (~6 min)")
    # Its log goes to a file: llama.cpp prints more than a pipe holds, and a full pipe stalls it.
    with tempfile.TemporaryDirectory() as folder:
        log_path = Path(folder) / "llamacpp.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(["bash", str(SCRIPT), mode, "0"], stdout=log, stderr=subprocess.STDOUT)
        try:
            base = listening_url(proc, log_path, timeout=120)
            wait_ready(base, proc, timeout=120, path="/v1/models", log_path=log_path)
            yield base
        finally:
            proc.terminate()
            proc.wait(timeout=30)


@pytest.fixture(scope="module")
def clients(llamacpp):
    with GatewayServer(FRONT.format(base=llamacpp)) as front:
        direct = openai.OpenAI(base_url=llamacpp + "/v1", api_key="unused", max_retries=0, timeout=120)
        yield direct, front.openai(timeout=120)


def test_greedy_completion_through_kvgate_equals_llamacpp(clients):
    direct, front = clients
    kw = dict(prompt="The capital of France is", max_tokens=12, temperature=0)
    direct.completions.create(model="smollm2", **kw)  # warm llama.cpp's prompt cache (see below)
    want = direct.completions.create(model="smollm2", **kw)
    got = front.completions.create(model="smol", **kw)
    assert got.choices[0].text == want.choices[0].text
    assert got.choices[0].finish_reason == want.choices[0].finish_reason
    assert got.usage.completion_tokens == want.usage.completion_tokens


def test_streamed_chat_through_kvgate_equals_llamacpp(clients):
    direct, front = clients
    kw = dict(messages=[{"role": "user", "content": "Name three colours."}], max_tokens=16, temperature=0)
    # llama.cpp's first run of a prompt can differ from later runs that reuse its prompt cache
    # (seen: another greedy continuation); compare against a warm, repeatable answer.
    direct.chat.completions.create(model="smollm2", **kw)
    want = direct.chat.completions.create(model="smollm2", **kw).choices[0].message.content
    chunks = front.chat.completions.create(model="smol", stream=True, **kw)
    got = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert got == want and got


def test_continuous_usage_through_kvgate_counts_what_llamacpp_sends(clients):
    """llama-cpp-python's server sends no usage in its streams: through kvgate every chunk carries
    the output tokens counted so far (prompt tokens unknown: 0), the last chunk their total."""
    direct, front = clients
    kw = dict(prompt="The capital of France is", max_tokens=8, temperature=0)
    direct.completions.create(model="smollm2", **kw)  # warm llama.cpp's prompt cache
    want = direct.completions.create(model="smollm2", **kw).usage
    chunks = [c.model_dump() for c in front.completions.create(
        model="smol", stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True}, **kw)]
    counts = [c["usage"]["completion_tokens"] for c in chunks[:-1] if c["choices"][0]["text"]]
    assert counts == list(range(1, len(counts) + 1)) and counts
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == want.completion_tokens


def test_llamacpp_refusal_reaches_the_client_as_a_4xx(clients):
    _, front = clients
    with pytest.raises(openai.BadRequestError):
        front.completions.create(model="smol", prompt="word " * 3000, max_tokens=16)


# -- tools, JSON, embeddings and tokenize, against llama-cpp-python's own implementations ---------
# `serve-features`: two aliases of the model file (tools need chat format chatml-function-calling,
# embeddings a model loaded with embedding on). Every answer through kvgate must equal the same
# request sent to llama.cpp directly, once that has run once (see `warm_then_direct`).

FEATURES = """
models:
  - name: smol-tools
    deployments:
      - name: llamacpp-tools
        backend: openai
        upstream_model: smollm2-tools
        settings: {{base_url: "{base}/v1", server: llama_cpp_python, metrics: none, first_byte_s: 120}}
  - name: smol-embed
    deployments:
      - name: llamacpp-embed
        backend: openai
        upstream_model: smollm2-embed
        settings: {{base_url: "{base}/v1", server: llama_cpp_python, metrics: none, first_byte_s: 120}}
"""
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
FORCED = {"type": "function", "function": {"name": "get_weather"}}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def features():
    with llamacpp_server("serve-features") as base, GatewayServer(FEATURES.format(base=base)) as front:
        yield base, openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=180), front


def warm_then_direct(direct, **kw):
    """llama.cpp's answer to a request it has seen once: its first run of a prompt can differ
    from later ones that reuse its prompt cache (and it swaps models between the two aliases)."""
    direct.chat.completions.create(model="smollm2-tools", **kw)
    return direct.chat.completions.create(model="smollm2-tools", **kw)


def test_forced_tool_call_and_the_tool_result_round_trip_equal_llamacpp(features):
    _, direct, front = features
    client = front.openai(timeout=180)
    kw = dict(messages=ASK, tools=[WEATHER], tool_choice=FORCED, temperature=0, max_tokens=48)
    want = warm_then_direct(direct, **kw).choices[0]
    got = client.chat.completions.create(model="smol-tools", **kw).choices[0]
    assert got.finish_reason == want.finish_reason == "tool_calls"
    call = got.message.tool_calls[0]
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == json.loads(want.message.tool_calls[0].function.arguments)
    assert isinstance(json.loads(call.function.arguments)["city"], str)
    # The client sends the call's message back with content null, as OpenAI's API has it;
    # llama-cpp-python wants "" (a 500 otherwise): kvgate says it that way for this server kind.
    tool_result = {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 degrees."}
    assistant = got.message.model_dump(exclude_none=True)
    want = warm_then_direct(direct, messages=ASK + [{**assistant, "content": ""}, tool_result],
                            temperature=0, max_tokens=24).choices[0].message.content
    got = client.chat.completions.create(model="smol-tools", messages=ASK + [{**assistant, "content": None}, tool_result],
                                         temperature=0, max_tokens=24).choices[0].message.content
    assert got == want and got


def test_streamed_forced_tool_call_adds_up_to_the_whole_one(features):
    _, direct, front = features
    kw = dict(messages=ASK, tools=[WEATHER], tool_choice=FORCED, temperature=0, max_tokens=48)
    whole = warm_then_direct(direct, **kw).choices[0].message.tool_calls[0]
    name, arguments, finish = None, "", None
    for chunk in front.openai(timeout=180).chat.completions.create(model="smol-tools", stream=True, **kw):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or ():
                name = name or (delta.function.name if delta.function else None)
                arguments += (delta.function.arguments or "") if delta.function else ""
    assert name == "get_weather" and finish == "tool_calls"
    assert json.loads(arguments) == json.loads(whole.function.arguments)


def test_json_mode_through_kvgate_equals_llamacpp_and_parses(features):
    _, direct, front = features
    kw = dict(messages=[{"role": "user", "content": "Give a JSON object with a name and an age."}],
              response_format={"type": "json_object"}, temperature=0, max_tokens=48)
    want = warm_then_direct(direct, **kw).choices[0].message.content
    got = front.openai(timeout=180).chat.completions.create(model="smol-tools", **kw).choices[0].message.content
    assert got == want
    if got.rstrip().endswith("}"):  # within max_tokens the grammar closes it
        assert isinstance(json.loads(got), dict)


def test_embeddings_through_kvgate_equal_llamacpp(features):
    _, direct, front = features
    texts = ["The capital of France is Paris.", "Bananas are yellow."]
    want = direct.embeddings.create(model="smollm2-embed", input=texts, encoding_format="float")
    got = front.openai(timeout=180).embeddings.create(model="smol-embed", input=texts)  # base64 from kvgate
    assert len(got.data) == 2 and len(got.data[0].embedding) == 576  # SmolLM2's hidden size
    for g, w in zip(got.data, want.data):
        assert max(abs(a - b) for a, b in zip(g.embedding, w.embedding)) < 1e-5
    assert got.usage.prompt_tokens == want.usage.prompt_tokens


def test_tokenize_and_detokenize_through_kvgate_equal_llamacpp(features):
    base, _, front = features
    text = "The quick brown fox jumps over the lazy dog."
    want = httpx.post(base + "/extras/tokenize", json={"input": text, "model": "smollm2-tools"}, timeout=120).json()
    got = httpx.post(front.base_url + "/tokenize", json={"model": "smol-tools", "prompt": text}, timeout=120).json()
    assert got["tokens"] == want["tokens"] and got["count"] == len(want["tokens"])
    back = httpx.post(front.base_url + "/detokenize", json={"model": "smol-tools", "tokens": got["tokens"]},
                      timeout=120).json()["prompt"]
    assert text in back
    refused = httpx.post(front.base_url + "/tokenize", timeout=120,
                         json={"model": "smol-tools", "messages": [{"role": "user", "content": "hi"}]})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "messages"


def test_a_json_schema_reaches_llama_cpp_python_in_its_own_shape(features):
    _, direct, front = features
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"]}
    messages = [{"role": "user", "content": "Invent a person."}]
    want = warm_then_direct(direct, messages=messages, temperature=0, max_tokens=48,
                            response_format={"type": "json_object", "schema": schema})
    got = front.openai(timeout=180).chat.completions.create(
        model="smol-tools", messages=messages, temperature=0, max_tokens=48,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}})
    assert got.choices[0].message.content == want.choices[0].message.content
    if got.choices[0].finish_reason == "stop":
        value = json.loads(got.choices[0].message.content)
        assert isinstance(value["name"], str) and isinstance(value["age"], int)
