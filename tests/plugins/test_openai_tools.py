"""Tools, structured outputs, reasoning and vendor fields through kvgate, with the real `openai`
client, to an upstream that implements them (tests/support/fakes/scripted_upstream.py) — and routed only to
deployments that declare them: a model whose deployments lack a feature answers 400 naming it."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import jsonschema
import openai
import pytest

from tests.support.servers.loopback import GatewayServer

CONFIG = """
server:
  limits: {{max_tools: 4, max_schema_depth: 6, max_schema_bytes: 2000, max_extra_fields: 2}}
models:
  - name: agent
    deployments:
      - name: vllm-0
        backend: openai
        upstream_model: scripted
        settings: {{base_url: "{base}/v1", server: vllm, metrics: none}}
  - name: mixed
    deployments:
      - name: echo-0
        backend: echo
      - name: vllm-1
        backend: openai
        upstream_model: scripted
        settings: {{base_url: "{base}/v1", server: vllm, metrics: none}}
  - name: plain
    deployments:
      - name: echo-1
        backend: echo
      - name: trtllm-0
        backend: openai
        upstream_model: scripted
        settings: {{base_url: "{base}/v1", server: trtllm, metrics: none}}
  - name: within
    deployments:
      - name: echo-2
        backend: echo
      - name: vllm-dead
        backend: openai
        settings: {{base_url: "http://127.0.0.1:{dead}/v1", server: vllm, metrics: none, connect_s: 1}}
"""

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age", "tags"], "additionalProperties": False}


@pytest.fixture(scope="module")
def gw(scripted_upstream):
    from tests.support.servers.loopback import free_port

    with GatewayServer(CONFIG.format(base=scripted_upstream.base_url, dead=free_port())) as server:
        yield server


@pytest.fixture(scope="module")
def client(gw):
    return gw.openai(timeout=30)


def test_tool_call_then_tool_result_round_trip(client, scripted_upstream):
    scripted_upstream.tool_arguments["get_weather"] = {"city": "Paris", "unit": "C"}
    first = client.chat.completions.create(model="agent", messages=ASK, tools=[WEATHER], tool_choice="auto")
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    assert (call.id, call.type, call.function.name) == ("call_0", "function", "get_weather")
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "C"}
    assert choice.message.content is None

    history = ASK + [choice.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "18 degrees, sunny"}]
    second = client.chat.completions.create(model="agent", messages=history, tools=[WEATHER])
    assert second.choices[0].finish_reason == "stop"
    assert second.choices[0].message.content == "Tool call_0 said: 18 degrees, sunny"
    sent = scripted_upstream.bodies("/v1/chat/completions")[-1]
    assert sent["messages"][1]["tool_calls"] == [call.model_dump()]
    assert sent["messages"][2] == {"role": "tool", "content": "18 degrees, sunny", "tool_call_id": "call_0"}
    assert sent["tools"] == [WEATHER]


def test_streamed_tool_calls_arrive_in_fragments_and_add_up(client, scripted_upstream):
    scripted_upstream.tool_arguments.pop("get_weather", None)  # arguments built from the schema
    stream = client.chat.completions.create(model="agent", messages=ASK, tools=[WEATHER, CLOCK],
                                            tool_choice="required", stream=True,
                                            stream_options={"include_usage": True})
    calls: dict[int, dict] = {}
    fragments, finish, usage = 0, None, None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or ():
                fragments += 1
                call = calls.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
                call["id"] = call["id"] or delta.id
                call["name"] = call["name"] or (delta.function.name if delta.function else None)
                call["arguments"] += (delta.function.arguments or "") if delta.function else ""
    assert finish == "tool_calls" and usage is not None and usage.completion_tokens > 0
    assert [calls[i]["name"] for i in sorted(calls)] == ["get_weather", "get_time"]
    assert fragments > 4  # really in pieces
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER["function"]["parameters"])
    jsonschema.validate(json.loads(calls[1]["arguments"]), CLOCK["function"]["parameters"])
    assert calls[1]["id"] == "call_1"


def test_named_tool_choice_and_parallel_flag_reach_the_upstream(client, scripted_upstream):
    answer = client.chat.completions.create(model="agent", messages=ASK, tools=[WEATHER, CLOCK],
                                            tool_choice={"type": "function", "function": {"name": "get_time"}},
                                            parallel_tool_calls=False)
    assert [c.function.name for c in answer.choices[0].message.tool_calls] == ["get_time"]
    sent = scripted_upstream.bodies("/v1/chat/completions")[-1]
    assert sent["tool_choice"] == {"type": "function", "function": {"name": "get_time"}}
    assert sent["parallel_tool_calls"] is False


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_answer_is_valid_against_the_schema(client, scripted_upstream, stream):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    kw = dict(model="agent", messages=[{"role": "user", "content": "Invent a person."}], response_format=fmt)
    if stream:
        text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw)
                       if c.choices)
    else:
        text = client.chat.completions.create(**kw).choices[0].message.content
    jsonschema.validate(json.loads(text), PERSON)
    assert scripted_upstream.bodies("/v1/chat/completions")[-1]["response_format"] == fmt


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_and_refusal_come_back(gw, stream):
    body = {"model": "agent", "messages": [{"role": "user", "content": "refuse: not today"}],
            "reasoning_effort": "low", "stream": stream}
    r = httpx.post(gw.base_url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    if stream:
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
        reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
        refusal = "".join(d.get("refusal", "") for d in deltas)
    else:
        message = r.json()["choices"][0]["message"]
        reasoning, refusal = message["reasoning_content"], message["refusal"]
    assert reasoning == "Thinking at low effort." and refusal == "not today"


def test_a_vendor_field_a_deployment_declared_is_forwarded_verbatim(client, scripted_upstream):
    kwargs = {"chat_template_kwargs": {"enable_thinking": False}, "min_tokens": 2}
    client.chat.completions.create(model="agent", messages=ASK, extra_body=kwargs)
    sent = scripted_upstream.bodies("/v1/chat/completions")[-1]
    assert {k: sent[k] for k in kwargs} == kwargs


def test_requests_that_need_tools_go_only_to_deployments_that_have_them(client, gw, scripted_upstream):
    before = len(scripted_upstream.bodies("/v1/chat/completions"))
    for _ in range(6):
        answer = client.chat.completions.create(model="mixed", messages=ASK, tools=[WEATHER])
        assert answer.choices[0].finish_reason == "tool_calls"
    assert len(scripted_upstream.bodies("/v1/chat/completions")) == before + 6
    # Plain requests still use both deployments (least_loaded takes equal ones in turn).
    for _ in range(4):
        client.chat.completions.create(model="mixed", messages=ASK, max_tokens=2)
    assert len(scripted_upstream.bodies("/v1/chat/completions")) == before + 8


def test_failover_stays_within_the_deployments_that_declare_the_feature(gw):
    body = {"model": "within", "messages": ASK, "tools": [WEATHER]}
    r = httpx.post(gw.base_url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_error"  # never echo-2's words
    plain = httpx.post(gw.base_url + "/v1/chat/completions", json={"model": "within", "messages": ASK}, timeout=30)
    assert plain.status_code == 200  # echo-2 answers (after vllm-dead fails, if it was tried first)


@pytest.mark.parametrize("extra, param, fragment", [
    ({"tools": [WEATHER]}, "tools", "'tools' (tools)"),
    ({"messages": ASK + [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "f", "arguments": "{}"}}]}, {"role": "tool", "tool_call_id": "c", "content": "x"}]}, "messages", "tools"),
    ({"response_format": {"type": "json_object"}}, "response_format", "json_object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}}, "response_format",
     "json_schema"),
    ({"reasoning_effort": "high"}, "reasoning_effort", "reasoning"),
    ({"chat_template_kwargs": {}}, "chat_template_kwargs", "Unrecognized request argument"),
])
def test_a_feature_no_deployment_declares_is_a_400_naming_it_and_them(gw, extra, param, fragment):
    body = {"model": "plain", "messages": ASK, **extra}
    r = httpx.post(gw.base_url + "/v1/chat/completions", json=body, timeout=10)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and fragment in error["message"]
    assert "echo-1" in error["message"] and "trtllm-0" in error["message"]


BAD = [
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": ["city"]}}]}, "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]},
     "tools[0].function.parameters.type"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools[0].function.parameters.type"),  # valid JSON Schema, but the arguments are an object
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"properties": {"a": {"minLength": -1}}}}}]},
     "tools[0].function.parameters.properties.a.minLength"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "$schema": "http://127.0.0.1:9/never-fetched", "type": "object"}}}]}, "tools[0].function.parameters.$schema"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "$schema": "http://json-schema.org/draft-07/schema#", "type": "objekt"}}}]}, "tools[0].function.parameters.type"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ({"tools": [WEATHER] * 5}, "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
     "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": 7}}}},
     "response_format.json_schema.schema.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": PERSON}}}, "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "deep", "schema": {
        "a": {"b": {"c": {"d": {"e": {"f": {"g": 1}}}}}}}}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "big", "schema": {
        "description": "x" * 3000}}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"messages": [{"role": "tool", "content": "no id"}]}, "messages[0]"),
    ({"messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]}, "messages[0]"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f"}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ({"a": 1, "b": 2, "c": 3}, "a"),
]


@pytest.mark.parametrize("extra, param", BAD)
def test_bad_tools_and_schemas_are_400s_naming_the_path_and_charge_no_breaker(gw, extra, param):
    body = {"model": "agent", "messages": ASK, **extra}
    r = httpx.post(gw.base_url + "/v1/chat/completions", json=body, timeout=10)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    deployment = next(d for d in gw.state.registry.deployments() if d.name == "vllm-0")
    assert deployment.breaker.state == "closed" and deployment.in_flight == 0


def test_openapi_shows_tools_and_vendor_fields_the_deployments_declare(gw):
    doc = httpx.get(gw.base_url + "/openapi.json").json()
    chat = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert chat["properties"]["tools"]["anyOf"][0]["maxItems"] == 4
    assert "chat_template_kwargs" in chat["properties"] and chat["additionalProperties"] is False
    roles = [v["properties"]["role"]["enum"] for v in doc["components"]["schemas"]["Message"]["anyOf"]]
    assert ["tool"] in roles


@pytest.mark.parametrize("settings, message", [
    ({"server": "vllm2"}, "settings.server"),
    ({"capabilities": {"endpoints": ["chat", "embedings"]}}, "settings.capabilities.endpoints: unknown 'embedings'"),
    ({"capabilities": {"features": ["grammar"]}}, "settings.capabilities.features: unknown 'grammar'"),
    ({"capabilities": {"extras": "all"}}, "settings.capabilities.extras"),
])
def test_check_config_refuses_bad_capability_settings(tmp_path, settings, message):
    deployment = {"name": "u", "backend": "openai", "settings": {"base_url": "http://127.0.0.1:9/v1", **settings}}
    path = tmp_path / "bad.yaml"
    path.write_text(json.dumps({"models": [{"name": "m", "deployments": [deployment]}]}))
    result = subprocess.run([sys.executable, "-m", "gateway.cli", "check-config", str(path)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert f"models[0].deployments[0].{message}" in result.stderr + result.stdout


def test_capability_overrides_replace_the_kinds_defaults():
    from kvgate_openai import parse_settings

    vllm = parse_settings({"base_url": "http://x/v1", "server": "vllm"}).declared()
    assert "tokenize" in vllm.endpoints and "embeddings" not in vllm.endpoints and "tools" in vllm.features
    assert "chat_template_kwargs" in vllm.extras
    more = parse_settings({"base_url": "http://x/v1", "server": "vllm",
                           "capabilities": {"endpoints": ["chat", "embeddings"]}}).declared()
    assert more.endpoints == {"chat", "embeddings"} and more.features == vllm.features
    assert parse_settings({"base_url": "http://x/v1", "server": "kvgate"}).declared().extras == {"*"}
    trt = parse_settings({"base_url": "http://x/v1", "server": "trtllm"}).declared()
    assert "tools" not in trt.features and not trt.extras


def test_wire_reads_the_shapes_servers_send_for_tool_calls_and_reasoning():
    from kvgate_openai import wire

    delta = {"choices": [{"index": 0, "delta": {"reasoning": "hmm", "tool_calls": [
        {"index": 1, "id": "c1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]},
        "finish_reason": None}]}
    event = wire.chunk_event(delta, chat=True)
    assert event.reasoning == "hmm"  # newer vLLM's name for reasoning_content
    assert event.tool_calls[0].index == 1 and json.loads(event.tool_calls[0].arguments) == {"a": 1}
    whole = {"choices": [{"index": 0, "finish_reason": "function_call", "message": {
        "role": "assistant", "content": None, "refusal": None, "tool_calls": [
            {"id": "x", "type": "function", "function": {"name": "g", "arguments": "{}"}},
            {"id": "y", "type": "function", "function": {"name": "h", "arguments": "[1]"}}]}}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2}}
    event = wire.whole_event(whole, chat=True)
    assert event.finish_reason == "tool_calls" and [c.index for c in event.tool_calls] == [0, 1]
    assert event.usage.prompt_tokens == 3 and event.refusal == "" and event.text == ""
    plain = wire.chunk_event({"choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": None}]}, chat=True)
    assert plain.text == "hi" and plain.tool_calls == ()


def test_llama_cpp_python_gets_a_json_schema_and_tool_call_messages_in_its_own_shape():
    from kvgate_openai import wire

    messages = [{"role": "assistant", "content": None, "tool_calls": []}]
    body = {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "object"}}},
            "messages": messages}
    wire.for_llama_cpp_python(body)
    assert body["response_format"] == {"type": "json_object", "schema": {"type": "object"}}
    assert body["messages"][0]["content"] == "" and messages[0]["content"] is None
