"""The Anthropic Messages translation: requests to chat bodies, chat answers and stream chunks
to Anthropic's shapes, each checked against the `anthropic` SDK's own types."""

import pytest
from anthropic.types import Message, RawMessageStreamEvent

from gateway.config import RequestLimits
from gateway.errors import BackendError, InvalidRequestError, RateLimited
from gateway.translate.anthropic import MessagesBody, chat_body, error_body, parse_messages
from tests.support.checks.translated_streams import chunk, named_events, sdk_event_types, usage_chunk
from tests.support.checks.translated_streams import shape as shape_of

LIMITS = RequestLimits()
EVENT_TYPES = sdk_event_types(RawMessageStreamEvent)  # (ping and error are not in it)


def refusal(body: dict) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as caught:
        parse_messages(body, LIMITS)
    return caught.value


def events(raw: bytes) -> list[dict]:
    return named_events(raw, EVENT_TYPES)


def shape():
    return shape_of("msg_abc")


def body(**fields) -> dict:
    return {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], **fields}


def test_system_messages_and_sampling_map_onto_chat():
    parsed = parse_messages(body(system=[{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}],
                                 stop_sequences=["END"], temperature=0.25, top_k=5, metadata={"user_id": "u1"},
                                 stream=True), LIMITS)
    assert parsed.messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    s = parsed.sampling
    assert (s.max_tokens, s.stop, s.temperature, s.top_k, parsed.user) == (5, ("END",), 0.25, 5, "u1")
    assert parsed.stream and parsed.include_usage


def test_tool_use_and_tool_result_blocks_become_tool_calls_and_tool_messages():
    req = MessagesBody.model_validate(body(
        messages=[{"role": "user", "content": "weather?"},
                  {"role": "assistant", "content": [
                      {"type": "text", "text": "Checking."},
                      {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Oslo"}}]},
                  {"role": "user", "content": [
                      {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "-3C"}]},
                      {"type": "text", "text": "and tomorrow?"}]},
                  {"role": "assistant", "content": [
                      {"type": "tool_use", "id": "toolu_2", "name": "weather", "input": {}}]},
                  {"role": "user", "content": [
                      {"type": "tool_result", "tool_use_id": "toolu_2", "content": "down", "is_error": True}]}],
        tools=[{"name": "weather", "description": "d", "input_schema": {"type": "object"}}],
        tool_choice={"type": "any", "disable_parallel_tool_use": True}))
    chat = chat_body(req)
    assert chat["messages"] == [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "-3C"},
        {"role": "user", "content": "and tomorrow?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "toolu_2", "type": "function", "function": {"name": "weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: down"}]
    assert chat["tools"] == [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"},
                                                               "description": "d"}}]
    assert (chat["tool_choice"], chat["parallel_tool_calls"]) == ("required", False)


@pytest.mark.parametrize("choice, chat", [
    ({"type": "auto"}, "auto"), ({"type": "none"}, "none"),
    ({"type": "tool", "name": "f"}, {"type": "function", "function": {"name": "f"}})])
def test_tool_choice_maps_onto_chat(choice, chat):
    req = MessagesBody.model_validate(body(tools=[{"name": "f", "input_schema": {"type": "object"}}],
                                           tool_choice=choice))
    assert chat_body(req)["tool_choice"] == chat


@pytest.mark.parametrize("request_body, param", [
    ({"model": "m", "messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
    (body(max_tokens=0), "max_tokens"),
    (body(max_tokens=LIMITS.max_tokens + 1), "max_tokens"),
    (body(messages=[]), "messages"),
    (body(messages=[{"role": "system", "content": "x"}]), "messages[0].role"),
    (body(messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}]), "messages[0].content[0].type"),
    (body(messages=[{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": {}}]}]),
     "messages[0].content[0].type"),
    (body(messages=[{"role": "assistant", "content": [{"type": "tool_use", "id": "a", "name": "f"}]}]),
     "messages[0].content[0].input"),
    (body(messages=[{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "a",
                                                  "content": [{"type": "image"}]}]}]),
     "messages[0].content[0].content[0].type"),
    (body(system=[{"type": "image"}]), "system[0].type"),
    (body(tools=[{"type": "web_search_20250305", "name": "web_search"}]), "tools[0].type"),
    (body(tools=[{"name": "f"}]), "tools[0].input_schema"),
    (body(tool_choice={"type": "tool"}), "tool_choice"),
    (body(thinking={"type": "enabled", "budget_tokens": 1024}), "thinking"),
    (body(temperature=1.5), "temperature"),
    (body(stop_sequences=["a"] * (LIMITS.max_stop + 1)), "stop_sequences"),
    (body(unknown_field=1), "unknown_field"),
])
def test_bad_input_is_a_400_naming_its_path(request_body, param):
    assert refusal(request_body).param == param


def test_the_error_shape_is_anthropics():
    assert error_body(400, "bad") == {"type": "error", "error": {"type": "invalid_request_error", "message": "bad"}}
    assert error_body(429, "slow")["error"]["type"] == "rate_limit_error"
    assert error_body(503, "busy")["error"]["type"] == "overloaded_error"
    assert error_body(502, "down")["error"]["type"] == "api_error"
    assert error_body(504, "late")["error"]["type"] == "timeout_error"


def _stream(chunks: list[dict]) -> list[dict]:
    writer = parse_messages(body(stream=True), LIMITS).translation.stream(shape())
    out = []
    for c in chunks:
        out += events(writer.chunk(c))
    return out


def test_a_text_stream_is_anthropics_event_sequence():
    out = _stream([chunk({"role": "assistant", "content": ""}), chunk({"content": "Hel"}), chunk({"content": "lo"}),
                   chunk({}, "stop"), usage_chunk(7, 2)])
    assert [e["type"] for e in out] == ["message_start", "ping", "content_block_start", "content_block_delta",
                                        "content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    assert "".join(e["delta"]["text"] for e in out if e["type"] == "content_block_delta") == "Hello"
    assert out[-2]["delta"]["stop_reason"] == "end_turn"
    assert (out[-2]["usage"]["input_tokens"], out[-2]["usage"]["output_tokens"]) == (7, 2)


def test_streamed_tool_calls_are_tool_use_blocks_one_after_the_other():
    out = _stream([
        chunk({"content": "Sure."}),
        chunk({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                               "function": {"name": "f", "arguments": ""}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"a": '}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]}),
        chunk({"tool_calls": [{"index": 1, "id": "call_2", "type": "function",
                               "function": {"name": "g", "arguments": "{}"}}]}),
        chunk({}, "tool_calls"), usage_chunk()])
    starts = [e for e in out if e["type"] == "content_block_start"]
    assert [(e["index"], e["content_block"]["type"]) for e in starts] == [(0, "text"), (1, "tool_use"), (2, "tool_use")]
    assert starts[1]["content_block"]["id"] == "call_1" and starts[1]["content_block"]["name"] == "f"
    json_parts = [e["delta"]["partial_json"] for e in out if e["type"] == "content_block_delta" and e["index"] == 1]
    assert "".join(json_parts) == '{"a": 1}'
    # each block stops before the next starts
    kinds = [(e["type"], e["index"]) for e in out if e["type"] in ("content_block_start", "content_block_stop")]
    assert kinds == [("content_block_start", 0), ("content_block_stop", 0), ("content_block_start", 1),
                     ("content_block_stop", 1), ("content_block_start", 2), ("content_block_stop", 2)]
    assert out[-2]["delta"]["stop_reason"] == "tool_use"


def test_an_empty_reply_is_one_empty_text_block():
    out = _stream([chunk({"role": "assistant", "content": ""}), chunk({}, "stop"), usage_chunk(3, 0)])
    assert [e["type"] for e in out][2:5] == ["content_block_start", "content_block_stop", "message_delta"]


def test_a_failure_after_the_start_is_an_error_event():
    writer = parse_messages(body(stream=True), LIMITS).translation.stream(shape())
    out = events(writer.chunk(chunk({"content": "a"})) + writer.error(BackendError("the backend died")))
    assert out[-1] == {"type": "error", "error": {"type": "api_error", "message": "the backend died"}}
    assert events(writer.error(RateLimited("slow down")))[-1]["error"]["type"] == "rate_limit_error"


def test_a_whole_answer_is_a_message_with_text_and_tool_use_blocks():
    translation = parse_messages(body(), LIMITS).translation
    chat = {"choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
        "role": "assistant", "content": "On it.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"x": [1, 2]}'}},
            {"id": "call_2", "type": "function", "function": {"name": "g", "arguments": "not json"}}]}}],
        "usage": {"prompt_tokens": 4, "completion_tokens": 6, "total_tokens": 10}}
    message = Message.model_validate(translation.whole(shape(), chat))
    assert message.stop_reason == "tool_use"
    assert [b.type for b in message.content] == ["text", "tool_use", "tool_use"]
    assert message.content[1].input == {"x": [1, 2]}
    assert message.content[2].input == {"arguments": "not json"}  # kept, not dropped
    assert (message.usage.input_tokens, message.usage.output_tokens) == (4, 6)


@pytest.mark.parametrize("finish, stop", [("stop", "end_turn"), ("length", "max_tokens"), ("tool_calls", "tool_use")])
def test_finish_reasons_map_onto_stop_reasons(finish, stop):
    translation = parse_messages(body(), LIMITS).translation
    chat = {"choices": [{"index": 0, "finish_reason": finish, "message": {"role": "assistant", "content": "x"}}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}
    assert translation.whole(shape(), chat)["stop_reason"] == stop


def test_thinking_sent_back_is_taken_and_not_sent_on():
    parsed = parse_messages(body(messages=[
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm", "signature": ""},
                                          {"type": "redacted_thinking", "data": "xyz"},
                                          {"type": "text", "text": "a"}]},
        {"role": "user", "content": "q2"}]), LIMITS)
    assert [m["content"] for m in parsed.messages] == ["q", "a", "q2"]


def test_streamed_reasoning_is_a_thinking_block_and_a_refusal_ends_as_one():
    out = _stream([chunk({"role": "assistant", "content": ""}), chunk({"reasoning_content": "Hm"}),
                   chunk({"reasoning_content": "m."}), chunk({"refusal": "I won't."}), chunk({}, "stop"),
                   usage_chunk()])
    starts = [e["content_block"]["type"] for e in out if e["type"] == "content_block_start"]
    assert starts == ["thinking", "text"]
    thinking = "".join(e["delta"]["thinking"] for e in out if e["type"] == "content_block_delta" and e["index"] == 0)
    text = "".join(e["delta"]["text"] for e in out if e["type"] == "content_block_delta" and e["index"] == 1)
    assert (thinking, text) == ("Hmm.", "I won't.")
    assert out[-2]["delta"]["stop_reason"] == "refusal"


def test_a_whole_answer_with_reasoning_has_a_thinking_block_first():
    translation = parse_messages(body(), LIMITS).translation
    chat = {"choices": [{"index": 0, "finish_reason": "stop", "message": {
        "role": "assistant", "content": "42", "reasoning_content": "Let me think."}}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 5, "total_tokens": 6}}
    message = Message.model_validate(translation.whole(shape(), chat))
    assert [b.type for b in message.content] == ["thinking", "text"]
    assert message.content[0].thinking == "Let me think." and message.stop_reason == "end_turn"


def test_over_many_content_blocks_are_refused_before_they_are_validated():
    """Thousands of tool_use blocks collapse into one chat message that max_messages does not
    count: the blocks across the messages are counted first (issue 40 item 8)."""
    limits = RequestLimits()
    with pytest.raises(InvalidRequestError) as info:
        parse_messages({"model": "m", "max_tokens": 5, "messages": [
            {"role": "assistant", "content": [{"type": "nope"}] * 2000}]}, limits)
    assert info.value.param == "messages" and "2000 input items" in info.value.message
    use = {"type": "tool_use", "id": "t", "name": "f", "input": {}}
    with pytest.raises(InvalidRequestError) as info:
        parse_messages({"model": "m", "max_tokens": 5, "messages": [
            {"role": "user", "content": "hi"}, {"role": "assistant", "content": [use] * 300}]}, limits)
    assert info.value.param == "messages" and "300 tool_use items" in info.value.message


def test_a_cache_salt_is_carried_onto_the_chat_request_and_checked_there():
    body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    parsed = parse_messages({**body, "cache_salt": "mine"}, RequestLimits())
    assert parsed.extra == {"cache_salt": "mine"} and "cache_salt" in parsed.needs.extras
    with pytest.raises(InvalidRequestError) as info:
        parse_messages({**body, "cache_salt": ""}, RequestLimits())
    assert info.value.param == "cache_salt"
