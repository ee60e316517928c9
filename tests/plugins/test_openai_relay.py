"""The openai backend's relay of a passed-through Responses answer: each event re-sent whole,
with the text, the end and the usage read from it for the gateway's books."""

import json

import pytest

from gateway.backend import Usage
from kvgate_openai.relay import is_error, stream_event, whole_event


def payload(data: dict) -> bytes:
    return json.dumps(data).encode()


def test_a_text_delta_is_relayed_whole_and_counted_as_text():
    data = payload({"type": "response.output_text.delta", "sequence_number": 4, "delta": "Hi", "item_id": "m"})
    event = stream_event(data)
    assert event.raw == b"event: response.output_text.delta\ndata: " + data + b"\n\n"
    assert (event.text, event.finish_reason) == ("Hi", None)


@pytest.mark.parametrize("kind, status, output, finish", [
    ("response.completed", "completed", [{"type": "message", "content": []}], "stop"),
    ("response.completed", "completed", [{"type": "function_call", "name": "f"}], "tool_calls"),
    ("response.incomplete", "incomplete", [], "length"),
])
def test_the_last_event_ends_the_choice_with_its_usage(kind, status, output, finish):
    response = {"status": status, "output": output,
                "usage": {"input_tokens": 7, "output_tokens": 3, "input_tokens_details": {"cached_tokens": 2}}}
    event = stream_event(payload({"type": kind, "sequence_number": 9, "response": response}))
    assert (event.finish_reason, event.usage) == (finish, Usage(7, 3, 2))


@pytest.mark.parametrize("bad", [b"[1, 2]", b'{"no": "type"}', b'{"type": "x\\ndata: forged"}', b"not json"])
def test_an_event_that_is_not_a_typed_object_is_refused(bad):
    with pytest.raises(ValueError):
        stream_event(bad)


def test_a_whole_response_is_relayed_as_its_bytes():
    body = {"status": "completed", "usage": {"input_tokens": 2, "output_tokens": 2},
            "output": [{"type": "message", "content": [{"type": "output_text", "text": "a "},
                                                       {"type": "output_text", "text": "b"}]}]}
    raw = payload(body)
    event = whole_event(body, raw)
    assert (event.raw, event.text, event.finish_reason, event.usage) == (raw, "a b", "stop", Usage(2, 2))


def test_an_error_event_is_relayed_and_known_but_does_not_end_the_stream():
    event = stream_event(payload({"type": "error", "sequence_number": 3, "code": "x", "message": "m", "param": None}))
    assert is_error(event) and event.finish_reason is None  # a response.failed may follow
    assert not is_error(stream_event(payload({"type": "response.in_progress", "sequence_number": 1})))
