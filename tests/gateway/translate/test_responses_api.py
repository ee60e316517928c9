"""The Responses API translation: requests to chat bodies, chat answers and stream chunks to the
Responses shapes, each event checked against the `openai` SDK's own types."""

import pytest
from openai.types.responses import Response, ResponseStreamEvent

from gateway.config import RequestLimits
from gateway.errors import BackendError, InvalidRequestError
from gateway.translate.responses_api import ResponsesBody, chat_body, parse_responses
from tests.support.checks.translated_streams import chunk, named_events, sdk_event_types, usage_chunk
from tests.support.checks.translated_streams import shape as shape_of

LIMITS = RequestLimits()
EVENT_TYPES = sdk_event_types(ResponseStreamEvent)


def refusal(body: dict) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as caught:
        parse_responses(body, LIMITS)
    return caught.value


def events(raw: bytes) -> list[dict]:
    out = named_events(raw, EVENT_TYPES)
    assert all(e["type"] in EVENT_TYPES for e in out)  # every event is one the SDK knows
    return out


def shape():
    return shape_of("resp_abc")


def test_a_string_input_is_one_user_message_after_the_instructions():
    parsed = parse_responses({"model": "m", "input": "hi there", "instructions": "be brief",
                              "max_output_tokens": 7, "temperature": 0.5, "stream": True}, LIMITS)
    assert parsed.messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    assert (parsed.sampling.max_tokens, parsed.sampling.temperature) == (7, 0.5)
    assert parsed.stream and parsed.include_usage  # the usage is needed for response.completed


def test_message_items_keep_their_roles_and_join_their_text_parts():
    parsed = parse_responses({"model": "m", "input": [
        {"role": "developer", "content": "rules"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a "},
                                                        {"type": "input_text", "text": "b"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "c", "annotations": []}]},
        {"role": "user", "content": "d"}]}, LIMITS)
    assert parsed.messages == [{"role": "system", "content": "rules"}, {"role": "user", "content": "a b"},
                               {"role": "assistant", "content": "c"}, {"role": "user", "content": "d"}]


def test_function_items_become_the_assistant_tool_calls_and_tool_messages():
    req = ResponsesBody.model_validate({"model": "m", "input": "x", "tools": [
        {"type": "function", "name": "add", "parameters": {"type": "object"}}],
        "tool_choice": {"type": "function", "name": "add"}})
    from gateway.translate.responses_api import _input_items

    items = _input_items([
        {"role": "user", "content": "2+3?"},
        {"type": "function_call", "call_id": "c1", "name": "add", "arguments": '{"a":2,"b":3}'},
        {"type": "function_call", "call_id": "c2", "name": "add", "arguments": '{"a":0,"b":0}'},
        {"type": "function_call_output", "call_id": "c1", "output": "5"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "0"}]}])
    body = chat_body(req, items)
    assert body["messages"] == [
        {"role": "user", "content": "2+3?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a":2,"b":3}'}},
            {"id": "c2", "type": "function", "function": {"name": "add", "arguments": '{"a":0,"b":0}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "5"},
        {"role": "tool", "tool_call_id": "c2", "content": "0"}]
    assert body["tools"] == [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    assert body["tool_choice"] == {"type": "function", "function": {"name": "add"}}


def test_text_format_becomes_the_chat_response_format():
    req = ResponsesBody.model_validate({"model": "m", "input": "x", "text": {"format": {
        "type": "json_schema", "name": "point", "schema": {"type": "object"}, "strict": True}}})
    assert chat_body(req, [])["response_format"] == {
        "type": "json_schema", "json_schema": {"name": "point", "schema": {"type": "object"}, "strict": True}}


@pytest.mark.parametrize("body, param", [
    ({"model": "m", "input": [{"role": "user", "content": "x"}, {"type": "web_search_call", "id": "w"}]},
     "input[1].type"),
    ({"model": "m", "input": "x", "reasoning": {"effort": "enormous"}}, "reasoning.effort"),
    ({"model": "m", "input": "x", "reasoning": {"summary": "auto"}}, "reasoning.summary"),
    ({"model": "m", "input": [{"type": 7}]}, "input[0].type"),
    ({"model": "m", "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
     "input[0].content[0].type"),
    ({"model": "m", "input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
    ({"model": "m", "input": ["just a string"]}, "input[0]"),
    ({"model": "m", "input": []}, "input"),
    ({"model": "m"}, "input"),
    ({"model": "m", "input": "x", "store": True}, "store"),
    ({"model": "m", "input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"model": "m", "input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"model": "m", "input": "x", "tools": [{"type": "function"}]}, "tools[0].name"),
    ({"model": "m", "input": "x", "tool_choice": {"type": "file_search"}}, "tool_choice.type"),
    ({"model": "m", "input": "x", "max_output_tokens": 10**6}, "max_output_tokens"),
    ({"model": "m", "input": "x", "truncation": "auto"}, "truncation"),
    ({"model": "m", "input": "x", "frequency": 1}, "frequency"),
])
def test_bad_input_is_a_400_naming_its_path(body, param):
    assert refusal(body).param == param


def test_an_unknown_item_type_says_which_types_are_taken():
    error = refusal({"model": "m", "input": [{"type": "item_reference", "id": "x"}]})
    assert error.status == 400 and "'item_reference'" in error.message and "function_call_output" in error.message


def test_a_limit_of_the_chat_request_is_named_in_responses_terms():
    error = refusal({"model": "m", "input": "x", "max_output_tokens": LIMITS.max_tokens + 1})
    assert error.param == "max_output_tokens" and "max_output_tokens" in error.message


def _run(translation_input: dict, chunks: list[dict]) -> list[dict]:
    parsed = parse_responses({"model": "m", "input": "x", "stream": True, **translation_input}, LIMITS)
    writer = parsed.translation.stream(shape())
    out = []
    for c in chunks:
        out += events(writer.chunk(c))
    return out


def test_a_text_stream_is_the_responses_events_in_order():
    out = _run({}, [chunk({"role": "assistant", "content": ""}), chunk({"content": "Hel"}), chunk({"content": "lo"}),
                    chunk({}, "stop"), usage_chunk()])
    assert [e["type"] for e in out] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    assert out[6]["text"] == "Hello"
    final = Response.model_validate(out[-1]["response"])
    assert final.output_text == "Hello" and final.status == "completed"
    assert (final.usage.input_tokens, final.usage.output_tokens, final.usage.total_tokens) == (3, 2, 5)


def test_a_stream_cut_by_max_output_tokens_ends_incomplete():
    out = _run({"max_output_tokens": 2}, [chunk({"content": "a"}), chunk({"content": " b"}, "length"), usage_chunk()])
    assert out[-1]["type"] == "response.incomplete"
    assert out[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert out[-2]["item"]["status"] == "incomplete"


def test_streamed_tool_calls_are_function_call_items_after_the_text():
    out = _run({}, [
        chunk({"content": "Let me add."}),
        chunk({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                               "function": {"name": "add", "arguments": ""}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"a":'}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": "2}"}}]}),
        chunk({"tool_calls": [{"index": 1, "id": "call_2", "type": "function",
                               "function": {"name": "neg", "arguments": '{"x":1}'}}]}),
        chunk({}, "tool_calls"), usage_chunk()])
    kinds = [e["type"] for e in out]
    # the message closes before the first call opens; calls close in output order at the end
    message_done = kinds.index("response.output_item.done")
    first_call = next(i for i, e in enumerate(out) if e["type"] == "response.output_item.added"
                      and e["item"]["type"] == "function_call")
    assert message_done < first_call
    args = [e for e in out if e["type"] == "response.function_call_arguments.done"]
    assert [(e["name"], e["arguments"], e["output_index"]) for e in args] == [("add", '{"a":2}', 1),
                                                                            ("neg", '{"x":1}', 2)]
    final = Response.model_validate(out[-1]["response"])
    assert [o.type for o in final.output] == ["message", "function_call", "function_call"]
    assert [(o.call_id, o.name, o.arguments) for o in final.output[1:]] == [("call_1", "add", '{"a":2}'),
                                                                          ("call_2", "neg", '{"x":1}')]


def test_an_empty_reply_is_still_one_message_item():
    out = _run({}, [chunk({"role": "assistant", "content": ""}), chunk({}, "stop"), usage_chunk(3, 0)])
    final = Response.model_validate(out[-1]["response"])
    assert [o.type for o in final.output] == ["message"] and final.output_text == ""


def test_a_failure_after_the_start_is_an_error_then_response_failed():
    parsed = parse_responses({"model": "m", "input": "x", "stream": True}, LIMITS)
    writer = parsed.translation.stream(shape())
    out = events(writer.chunk(chunk({"content": "a"})) + writer.error(BackendError("the backend died")))
    assert [e["type"] for e in out][-2:] == ["error", "response.failed"]
    assert out[-1]["response"]["error"]["message"] == "the backend died"
    assert writer.done == b""


def test_a_whole_answer_with_tool_calls_is_a_response_with_function_call_items():
    parsed = parse_responses({"model": "m", "input": "x"}, LIMITS)
    chat = {"choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
        "role": "assistant", "content": None,
        "tool_calls": [{"id": "call_9", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}}],
        "usage": {"prompt_tokens": 4, "completion_tokens": 6, "total_tokens": 10,
                  "prompt_tokens_details": {"cached_tokens": 2}}}
    body = parsed.translation.whole(shape(), chat)
    response = Response.model_validate(body)
    assert response.status == "completed" and [o.type for o in response.output] == ["function_call"]
    assert response.output[0].call_id == "call_9" and response.usage.input_tokens_details.cached_tokens == 2


def test_reasoning_effort_goes_on_and_reasoning_items_sent_back_do_not():
    parsed = parse_responses({"model": "m", "reasoning": {"effort": "low"}, "input": [
        {"role": "user", "content": "q"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hmm"}]},
        {"role": "assistant", "content": "a"}, {"role": "user", "content": "q2"}]}, LIMITS)
    assert parsed.reasoning_effort == "low"
    assert [m["content"] for m in parsed.messages] == ["q", "a", "q2"]


def test_streamed_reasoning_and_refusal_are_their_own_item_and_part():
    out = _run({}, [chunk({"role": "assistant", "content": ""}), chunk({"reasoning_content": "Think"}),
                    chunk({"reasoning_content": "ing."}), chunk({"content": "No"}), chunk({"refusal": "I can't."}),
                    chunk({}, "stop"), usage_chunk()])
    kinds = [e["type"] for e in out]
    assert kinds[2:] == [
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.delta", "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.content_part.added",
        "response.refusal.delta", "response.refusal.done", "response.content_part.done", "response.output_item.done",
        "response.completed"]
    final = Response.model_validate(out[-1]["response"])
    assert [o.type for o in final.output] == ["reasoning", "message"]
    assert final.output[0].content[0].text == "Thinking."
    assert [p.type for p in final.output[1].content] == ["output_text", "refusal"]
    assert final.output[1].content[1].refusal == "I can't."
    assert len({o.id for o in final.output}) == 2


def test_a_whole_answer_with_reasoning_has_a_reasoning_item_first():
    parsed = parse_responses({"model": "m", "input": "x"}, LIMITS)
    chat = {"choices": [{"index": 0, "finish_reason": "stop", "message": {
        "role": "assistant", "content": "42", "reasoning_content": "Let me think."}}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 5, "total_tokens": 6}}
    response = Response.model_validate(parsed.translation.whole(shape(), chat))
    assert [o.type for o in response.output] == ["reasoning", "message"]
    assert response.output[0].content[0].text == "Let me think." and response.output_text == "42"


def test_an_over_long_input_list_is_refused_before_its_items_are_validated():
    """2,000 items the server would refuse one by one (an unknown type) are refused by their count
    first (issue 40 item 8), and so are 300 function_call items, which become one chat message."""
    limits = RequestLimits()
    with pytest.raises(InvalidRequestError) as info:
        parse_responses({"model": "m", "input": [{"type": "nope"}] * 2000}, limits)
    assert info.value.param == "input" and "2000 input items, over this server's limit of 1024" in info.value.message
    call = {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}
    with pytest.raises(InvalidRequestError) as info:
        parse_responses({"model": "m", "input": [call] * 300 + [{"role": "user", "content": "hi"}]}, limits)
    assert info.value.param == "input" and "300 function_call items" in info.value.message
    parsed = parse_responses({"model": "m", "input": [call] * 3 + [{"role": "user", "content": "hi"}]}, limits)
    assert sum(len(m.get("tool_calls") or ()) for m in parsed.messages) == 3


def test_a_cache_salt_is_carried_onto_the_chat_request_and_checked_there():
    parsed = parse_responses({"model": "m", "input": "hi", "cache_salt": "mine"}, RequestLimits())
    assert parsed.extra == {"cache_salt": "mine"} and "cache_salt" in parsed.needs.extras
    with pytest.raises(InvalidRequestError) as info:
        parse_responses({"model": "m", "input": "hi", "cache_salt": 7}, RequestLimits())
    assert info.value.param == "cache_salt"
