"""The per-token pieces, trimmed for speed, mean what their general forms mean.

`responses.stream_chunk` (a head copied from the shape, finish_reason() only at the end) and
`wire.chunk_event` (finish_reason() only when a chunk has one, logprobs parsed only when present)
run once per token; they must give exactly what `ResponseShape.head`, `finish_reason` and
`_text_and_logprobs` give, and the adapter's chunk decoding keeps fastjson's fallback."""

from __future__ import annotations

import dataclasses
import json

import pytest

from gateway import fastjson
from gateway.backend import TokenEvent, TokenLogprob, ToolCallDelta, TopLogprob, Usage, token_event
from gateway.protocol.bodies import ResponseShape, finish_reason, sse, stream_chunk
from kvgate_openai import wire
from kvgate_openai.counts import token_count

EVENTS = [
    TokenEvent(text="hello"),
    TokenEvent(text="", finish_reason="length"),
    TokenEvent(text=" bye", finish_reason="abort"),  # internal: the client sees "stop"
    TokenEvent(text="a\ud800b"),  # a lone surrogate: orjson refuses it, the fallback escapes it
    TokenEvent(text="x", logprobs=(TokenLogprob("x", -0.5, (TopLogprob("x", -0.5), TopLogprob("y", -1.5))),)),
]


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("event", EVENTS)
def test_a_stream_chunk_is_the_head_plus_one_choice(chat, event):
    shape = ResponseShape(chat=chat, id="cmpl-1", model="m", created=7, want_logprobs=bool(event.logprobs))
    chunk = stream_chunk(shape, 3, event, first=False)
    assert {k: chunk[k] for k in ("id", "object", "created", "model")} == shape.head(
        "chat.completion.chunk" if chat else "text_completion")
    choice = chunk["choices"][0]
    assert choice["index"] == 3 and choice["finish_reason"] == finish_reason(event.finish_reason)
    assert (choice["delta"].get("content", "") if chat else choice["text"]) == event.text
    raw = sse(chunk)
    assert raw.startswith(b"data: ") and raw.endswith(b"\n\n")
    assert raw == b"data: " + fastjson.dumps(chunk) + b"\n\n"
    assert json.loads(raw[6:]) == chunk


def _general(chunk: dict, chat: bool):
    """chunk_event as it was written before it was inlined."""
    choices = chunk.get("choices")
    if not choices:
        return None
    c = choices[0]
    text, logprobs = wire._text_and_logprobs(c, chat, "delta")
    token_ids = tuple(c.get("token_ids") or ())
    reason = wire.finish_reason(c.get("finish_reason"))
    if not (text or logprobs or reason or token_ids):
        return None
    return TokenEvent(text=text, token_ids=token_ids, logprobs=logprobs, finish_reason=reason)


CHUNKS = [
    ({"choices": [{"index": 0, "text": " hi", "logprobs": None, "finish_reason": None}]}, False),
    ({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}, False),
    ({"choices": [{"index": 0, "text": "!", "finish_reason": "content_filter"}]}, False),
    ({"choices": [{"index": 0, "text": "a", "token_ids": [5, 6],
                   "logprobs": {"tokens": ["a"], "token_logprobs": [-0.1], "top_logprobs": [{"a": -0.1}]}}]}, False),
    ({"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 2}}, False),
    ({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}, True),
    ({"choices": [{"index": 0, "delta": {"content": " yo"}, "finish_reason": None}]}, True),
    ({"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]}, True),
    ({"choices": [{"index": 0, "delta": {"content": "z"},
                   "logprobs": {"content": [{"token": "z", "logprob": None, "top_logprobs": []}]}}]}, True),
]


@pytest.mark.parametrize("chunk,chat", CHUNKS)
def test_chunk_event_means_what_its_general_form_means(chunk, chat):
    assert wire.chunk_event(chunk, chat) == _general(chunk, chat)


def test_the_adapter_decodes_what_orjson_refuses_and_names_what_nobody_can():
    from gateway.errors import BackendError
    from kvgate_openai import make_openai_backend

    backend = make_openai_backend({"base_url": "http://127.0.0.1:9/v1", "metrics": "none"}, "up")
    assert backend._decode(b'{"choices": [{"text": "a\\ud800"}]}', 0) == {"choices": [{"text": "a\ud800"}]}
    with pytest.raises(BackendError, match="not JSON"):
        backend._decode(b"{nope", 0)
    with pytest.raises(BackendError, match="not an object"):
        backend._decode(b"[1, 2]", 0)


def test_a_chunk_carries_one_tool_call_entry_per_index():
    """A call's id and name and its first arguments, two fragments of one event, are one entry
    (OpenAI never repeats an index in a chunk); another call's fragments keep their own entry."""
    from gateway.backend import ToolCallDelta

    event = TokenEvent(tool_calls=(ToolCallDelta(0, arguments='"}'), ToolCallDelta(1, id="call-1", name="f"),
                                   ToolCallDelta(1, arguments='{"'), ToolCallDelta(1, arguments='a')))
    chunk = stream_chunk(ResponseShape(chat=True, id="c", model="m"), 0, event, first=False)
    assert chunk["choices"][0]["delta"]["tool_calls"] == [
        {"index": 0, "function": {"arguments": '"}'}},
        {"index": 1, "id": "call-1", "type": "function", "function": {"name": "f", "arguments": '{"a'}},
    ]


TOKEN_EVENT_FIELDS = [
    {},
    {"text": " hi"},
    {"text": "", "token_ids": (5, 6), "finish_reason": "length", "usage": Usage(3, 2, 1)},
    {"text": "x", "logprobs": (TokenLogprob("x", -0.5, 7, (TopLogprob("x", -0.5),)),)},
    {"tool_calls": (ToolCallDelta(0, "call_0", "f", '{"a"'),), "reasoning": "r", "refusal": "no"},
]


@pytest.mark.parametrize("fields", TOKEN_EVENT_FIELDS)
def test_token_event_is_the_dataclass_it_stands_for(fields):
    """The per-token constructor gives what TokenEvent(...) gives: every field, frozen."""
    event = token_event(**fields)
    assert event == TokenEvent(**fields) and repr(event) == repr(TokenEvent(**fields))
    with pytest.raises(dataclasses.FrozenInstanceError):
        event.text = "changed"


def _usage_general(chunk: dict):
    """usage_of as it was written before its common case was read once per chunk."""
    u = chunk.get("usage")
    if not u:
        return None
    if not isinstance(u, dict):
        raise ValueError("usage is not an object")
    details = u.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return Usage(token_count(u, "prompt_tokens"), token_count(u, "completion_tokens"),
                 token_count({"cached_tokens": cached}, "cached_tokens"))


USAGES = [
    None, {}, {"prompt_tokens": 36, "completion_tokens": 16}, {"completion_tokens": 4}, {"prompt_tokens": 2.0,
    "completion_tokens": 3}, {"prompt_tokens": 0, "completion_tokens": 2**31 - 1},
    {"prompt_tokens": 5, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 4}},
    {"prompt_tokens": 5, "completion_tokens": 1, "prompt_tokens_details": None},
    {"prompt_tokens": 5, "completion_tokens": 1, "prompt_tokens_details": [1]},
    {"prompt_tokens": True, "completion_tokens": 1}, {"prompt_tokens": -1, "completion_tokens": 1},
    {"prompt_tokens": 1, "completion_tokens": 2**31}, {"prompt_tokens": 1, "completion_tokens": 1.5},
    {"prompt_tokens": "3", "completion_tokens": 1}, {"prompt_tokens": 1, "completion_tokens": 1,
                                                    "prompt_tokens_details": {"cached_tokens": -2}}, [1],
]


@pytest.mark.parametrize("usage", USAGES)
def test_usage_read_once_means_what_its_general_form_means(usage):
    """The same Usage, or a ValueError naming the same field, as the general form; and the chunk's
    event carries it whether chunk_event reads it or is handed it."""
    chunk = {"choices": [{"index": 0, "text": " hi", "finish_reason": None}], "usage": usage}
    try:
        expected = _usage_general(chunk)
    except ValueError as exc:
        with pytest.raises(ValueError, match=str(exc).replace("[", r"\[").replace("]", r"\]")):
            wire.usage_of(chunk)
        return
    assert wire.usage_of(chunk) == expected
    assert wire.chunk_event(chunk, False) == wire.chunk_event(chunk, False, wire.usage_of(chunk)) == TokenEvent(
        text=" hi", usage=expected)
