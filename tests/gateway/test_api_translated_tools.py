"""Tools and JSON schemas through /v1/responses and /v1/messages, with the real `openai` and
`anthropic` SDKs, through kvgate to a loopback OpenAI-compatible upstream that implements them
(tests/support/fakes/scripted_upstream.py): tool calls come back as function_call items / tool_use blocks,
streamed in fragments, and the results the client sends back reach the upstream as tool
messages."""

from __future__ import annotations

import json

import anthropic
import jsonschema
import pytest

from tests.support.servers.loopback import GatewayServer

# The scripted upstream serves chat, not the Responses API a vLLM serves: it says so, and
# /v1/responses is translated onto chat for it (test_api_translated_passthrough has the other case).
CONFIG = """
models:
  - name: agent
    deployments:
      - name: vllm-0
        backend: openai
        upstream_model: scripted
        settings: {{base_url: "{base}/v1", server: vllm, metrics: none,
                    capabilities: {{endpoints: [chat, completions]}}}}
  - name: plain
    deployments:
      - {{name: echo-0, backend: echo}}
"""
WEATHER_PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
                      "required": ["city", "unit"]}
CLOCK_PARAMETERS = {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}
# The same two tools in each API's shape.
RESPONSES_TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city.",
                    "parameters": WEATHER_PARAMETERS},
                   {"type": "function", "name": "get_time", "parameters": CLOCK_PARAMETERS}]
ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "The weather in a city.", "input_schema": WEATHER_PARAMETERS},
                   {"name": "get_time", "input_schema": CLOCK_PARAMETERS}]
QUESTION = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def gw(scripted_upstream):
    with GatewayServer(CONFIG.format(base=scripted_upstream.base_url)) as server:
        yield server


@pytest.fixture(scope="module")
def oai(gw):
    return gw.openai(timeout=30)


@pytest.fixture(scope="module")
def claude(gw):
    return anthropic.Anthropic(base_url=gw.base_url, api_key="unused", max_retries=0, timeout=30)


# ------------------------------------------------------------------------------ Responses


def test_responses_function_call_round_trip(oai, scripted_upstream):
    scripted_upstream.tool_arguments["get_weather"] = {"city": "Paris", "unit": "C"}
    first = oai.responses.create(model="agent", input=QUESTION, tools=RESPONSES_TOOLS[:1], tool_choice="auto")
    assert first.status == "completed"
    [call] = first.output
    assert (call.type, call.call_id, call.name) == ("function_call", "call_0", "get_weather")
    assert json.loads(call.arguments) == {"city": "Paris", "unit": "C"}
    sent = scripted_upstream.bodies("/v1/chat/completions")[-1]
    assert sent["tools"] == [{"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city.", "parameters": WEATHER_PARAMETERS}}]

    history = [{"role": "user", "content": QUESTION}, *[item.model_dump(exclude_none=True) for item in first.output],
               {"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees, sunny"}]
    second = oai.responses.create(model="agent", input=history, tools=RESPONSES_TOOLS[:1])
    assert second.output_text == "Tool call_0 said: 18 degrees, sunny"
    sent = scripted_upstream.bodies("/v1/chat/completions")[-1]
    assert sent["messages"][1:] == [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": call.arguments}}]},
        {"role": "tool", "content": "18 degrees, sunny", "tool_call_id": "call_0"}]


def test_responses_streamed_function_calls_add_up(oai, scripted_upstream):
    scripted_upstream.tool_arguments.clear()  # arguments built from each tool's schema
    with oai.responses.stream(model="agent", input=QUESTION, tools=RESPONSES_TOOLS, tool_choice="required") as stream:
        seen = list(stream)
        final = stream.get_final_response()
    assert final.status == "completed"
    deltas = [e for e in seen if e.type == "response.function_call_arguments.delta"]
    assert len(deltas) > 4  # the upstream's fragments, passed on as they came
    calls = [o for o in final.output if o.type == "function_call"]
    assert [(c.call_id, c.name) for c in calls] == [("call_0", "get_weather"), ("call_1", "get_time")]
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER_PARAMETERS)
    jsonschema.validate(json.loads(calls[1].arguments), CLOCK_PARAMETERS)
    for call in calls:
        pieces = "".join(e.delta for e in deltas if e.item_id == call.id)
        assert pieces == call.arguments


def test_responses_text_stream_completes(oai):
    with oai.responses.stream(model="agent", input="hello from the stream") as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert final.status == "completed" and text == final.output_text == "hello from the stream"


def test_responses_json_schema_text_format(oai):
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    r = oai.responses.create(model="agent", input="a person", text={"format": {
        "type": "json_schema", "name": "person", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(r.output_text), schema)


def test_responses_tools_to_a_model_without_them_is_a_400_naming_tools(oai):
    import openai

    with pytest.raises(openai.BadRequestError) as caught:
        oai.responses.create(model="plain", input=QUESTION, tools=RESPONSES_TOOLS)
    assert caught.value.body["param"] == "tools" and "echo-0" in caught.value.body["message"]


# ------------------------------------------------------------------------------ Messages


def test_messages_tool_use_round_trip(claude, scripted_upstream):
    scripted_upstream.tool_arguments["get_weather"] = {"city": "Paris", "unit": "F"}
    first = claude.messages.create(model="agent", max_tokens=64, tools=ANTHROPIC_TOOLS[:1],
                                   messages=[{"role": "user", "content": QUESTION}])
    assert first.stop_reason == "tool_use"
    [use] = first.content
    assert (use.type, use.id, use.name, use.input) == ("tool_use", "call_0", "get_weather",
                                                       {"city": "Paris", "unit": "F"})
    second = claude.messages.create(model="agent", max_tokens=64, tools=ANTHROPIC_TOOLS[:1], messages=[
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "64F, clear"}]}])
    assert second.stop_reason == "end_turn" and second.content[0].text == "Tool call_0 said: 64F, clear"
    sent = scripted_upstream.bodies("/v1/chat/completions")[-1]
    assert sent["messages"][1]["tool_calls"][0]["function"] == {"name": "get_weather",
                                                                "arguments": json.dumps({"city": "Paris", "unit": "F"})}
    assert sent["messages"][2] == {"role": "tool", "content": "64F, clear", "tool_call_id": "call_0"}


def test_messages_stream_gathers_tool_use_inputs(claude, scripted_upstream):
    scripted_upstream.tool_arguments.clear()
    with claude.messages.stream(model="agent", max_tokens=64, tools=ANTHROPIC_TOOLS, tool_choice={"type": "any"},
                                messages=[{"role": "user", "content": QUESTION}]) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    assert [(b.type, b.id, b.name) for b in final.content] == [("tool_use", "call_0", "get_weather"),
                                                               ("tool_use", "call_1", "get_time")]
    jsonschema.validate(final.content[0].input, WEATHER_PARAMETERS)
    jsonschema.validate(final.content[1].input, CLOCK_PARAMETERS)
    assert kinds.count("input_json") > 4  # the SDK's event per partial_json delta


def test_messages_tool_choice_of_one_tool(claude, scripted_upstream):
    m = claude.messages.create(model="agent", max_tokens=64, tools=ANTHROPIC_TOOLS,
                               tool_choice={"type": "tool", "name": "get_time"},
                               messages=[{"role": "user", "content": "what time is it?"}])
    assert [b.name for b in m.content] == ["get_time"]
    assert scripted_upstream.bodies("/v1/chat/completions")[-1]["tool_choice"] == {"type": "function",
                                                                          "function": {"name": "get_time"}}


def test_messages_tools_to_a_model_without_them_is_anthropics_400(claude):
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.create(model="plain", max_tokens=8, tools=ANTHROPIC_TOOLS,
                               messages=[{"role": "user", "content": QUESTION}])
    error = caught.value.body["error"]
    assert error["type"] == "invalid_request_error" and "'tools'" in error["message"]


# ------------------------------------------------------------------------------ reasoning, refusals


def test_responses_reasoning_comes_back_as_a_reasoning_item(oai, scripted_upstream):
    r = oai.responses.create(model="agent", input="hello there", reasoning={"effort": "low"})
    assert scripted_upstream.bodies("/v1/chat/completions")[-1]["reasoning_effort"] == "low"
    assert [o.type for o in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == "Thinking at low effort." and r.output_text == "hello there"
    with oai.responses.stream(model="agent", input="hello there", reasoning={"effort": "high"}) as stream:
        kinds = {e.type for e in stream}
        final = stream.get_final_response()
    assert "response.reasoning_text.delta" in kinds
    assert final.output[0].content[0].text == "Thinking at high effort."


def test_responses_refusal_is_a_refusal_part(oai):
    r = oai.responses.create(model="agent", input="refuse: not this one")
    [message] = r.output
    assert [(p.type, p.refusal) for p in message.content] == [("refusal", "not this one")]
    with oai.responses.stream(model="agent", input="refuse: nor this") as stream:
        deltas = [e.delta for e in stream if e.type == "response.refusal.delta"]
    assert deltas == ["nor this"]


def test_messages_refusal_ends_as_a_refusal(claude):
    m = claude.messages.create(model="agent", max_tokens=32, messages=[{"role": "user", "content": "refuse: no way"}])
    assert (m.stop_reason, m.content[0].text) == ("refusal", "no way")
    with claude.messages.stream(model="agent", max_tokens=32,
                                messages=[{"role": "user", "content": "refuse: still no"}]) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.content[0].text) == ("refusal", "still no")
