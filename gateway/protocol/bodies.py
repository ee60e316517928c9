"""OpenAI response bodies and stream chunks, built from backend token events."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import cached_property

from gateway import fastjson
from gateway.backend import TokenEvent, TokenLogprob, ToolCallDelta, Usage


@dataclass
class ChoiceState:
    """What one choice has produced so far (non-streaming answers are built from it)."""

    index: int
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    usage: Usage | None = None
    tool_calls: dict[int, dict] = field(default_factory=dict)  # call index -> OpenAI tool call, merged
    reasoning: list[str] = field(default_factory=list)
    refusal: list[str] = field(default_factory=list)
    raw: list[bytes] = field(default_factory=list)  # a passed-through answer, as it came
    tokens: int = 0  # output tokens counted here (token ids, or text pieces when there are none)

    def add(self, event: TokenEvent) -> bool:
        """Take in one event; whether it shows the client anything, that is, whether a stream
        sends a chunk for it (token ids, usage or timings alone are not shown). Per token: each
        field is read once, here, and the stream writer asks this instead of reading them again."""
        text = event.text
        self.tokens += len(event.token_ids) or bool(text)
        if text:
            self.text.append(text)
        logprobs = event.logprobs
        self.logprobs.extend(logprobs)
        finish_reason = event.finish_reason
        if finish_reason:
            self.finish_reason = finish_reason
        if event.usage:
            self.usage = event.usage
        if event.tool_calls or event.reasoning or event.refusal or event.raw:  # more than text (rare)
            self._add_more(event)
            return True
        return bool(text or finish_reason or logprobs)

    def _add_more(self, event: TokenEvent) -> None:
        for delta in event.tool_calls:
            call = self.tool_calls.setdefault(delta.index, {"id": None, "type": "function",
                                                            "function": {"name": None, "arguments": ""}})
            call["id"] = call["id"] or delta.id
            call["function"]["name"] = call["function"]["name"] or delta.name
            call["function"]["arguments"] += delta.arguments
        if event.reasoning:
            self.reasoning.append(event.reasoning)
        if event.refusal:
            self.refusal.append(event.refusal)
        if event.raw:
            self.raw.append(event.raw)


@dataclass
class ResponseShape:
    """Fields shared by every body and chunk of one response."""

    chat: bool
    id: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))
    want_logprobs: bool = False

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    def head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    @cached_property
    def chunk_head(self) -> dict:
        """The head of every stream chunk of this response (copied per chunk, made once)."""
        return self.head("chat.completion.chunk" if self.chat else "text_completion")


def finish_reason(reason: str | None) -> str | None:
    # "abort" is internal; a client sees an aborted choice end as stop.
    return "stop" if reason == "abort" else reason


def total_usage(choices: list[ChoiceState], prompt_tokens_per_prompt: dict[int, int]) -> dict:
    """Prompt tokens count once per prompt (not once per choice), like OpenAI's n."""
    completion = sum(c.usage.completion_tokens for c in choices if c.usage)
    prompt = sum(prompt_tokens_per_prompt.values())
    cached = sum(c.usage.cached_tokens for c in choices if c.usage)
    usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    if cached:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return usage


def running_usage(state: ChoiceState, opened: bool = True) -> dict:
    """One choice's counts so far, for vLLM's continuous usage stats: the backend's own when its
    events carry them (native, echo, an upstream that sends them), else the tokens counted here
    (prompt tokens 0 until the backend says). The chat role opener (`opened` false) has none yet."""
    u = state.usage
    prompt = u.prompt_tokens if u else 0
    completion = (u.completion_tokens if u else state.tokens) if opened else 0
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def full_body(shape: ResponseShape, choices: list[ChoiceState], usage: dict) -> dict:
    body = shape.head(shape.object)
    body["choices"] = [_full_choice(shape, c) for c in choices]
    body["usage"] = usage
    return body


def _full_choice(shape: ResponseShape, c: ChoiceState) -> dict:
    text = "".join(c.text)
    logprobs = _logprobs(shape, c.logprobs) if shape.want_logprobs else None
    if shape.chat:
        return {
            "index": c.index,
            "message": _message(c, text),
            "logprobs": logprobs,
            "finish_reason": finish_reason(c.finish_reason),
        }
    return {"index": c.index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason(c.finish_reason)}


def _message(c: ChoiceState, text: str) -> dict:
    """The assistant message of a whole chat answer (content None when it only calls tools)."""
    message = {"role": "assistant", "content": text}
    if c.tool_calls:
        message["tool_calls"] = [c.tool_calls[i] for i in sorted(c.tool_calls)]
        message["content"] = text or None
    if c.reasoning:
        message["reasoning_content"] = "".join(c.reasoning)
    if c.refusal:
        message["refusal"] = "".join(c.refusal)
    return message


def _more_delta(delta: dict, event: TokenEvent) -> dict:
    """Add an event's tool-call fragments, reasoning and refusal to a stream chunk's delta."""
    if event.tool_calls:
        delta["tool_calls"] = _tool_call_deltas(event.tool_calls)
    if event.reasoning:
        delta["reasoning_content"] = event.reasoning
    if event.refusal:
        delta["refusal"] = event.refusal
    return delta


def _tool_call_deltas(deltas: tuple[ToolCallDelta, ...]) -> list[dict]:
    """One chunk's tool-call entries: one per call index, as OpenAI sends them (a backend may give
    a call's id and name and its first arguments as two fragments of one event; a client that
    does not merge entries of one index would see the call twice). Indexes keep their order."""
    merged: dict[int, ToolCallDelta] = {}
    for t in deltas:
        seen = merged.get(t.index)
        merged[t.index] = t if seen is None else ToolCallDelta(
            t.index, id=seen.id or t.id, name=seen.name or t.name, arguments=seen.arguments + t.arguments)
    return [_tool_call_delta(t) for t in merged.values()]


def _tool_call_delta(t: ToolCallDelta) -> dict:
    out: dict = {"index": t.index}
    function: dict = {}
    if t.id is not None:
        out["id"] = t.id
        out["type"] = "function"
    if t.name is not None:
        function["name"] = t.name
    function["arguments"] = t.arguments
    out["function"] = function
    return out


def stream_chunk(shape: ResponseShape, index: int, event: TokenEvent | None, first: bool) -> dict:
    """One SSE chunk for one choice. `event` None with `first` sends the chat role opener.
    (Runs per token: the head is copied from the shape, finish_reason() runs only at the end.)"""
    body = dict(shape.chunk_head)
    text = event.text if event else ""
    logprobs = _logprobs(shape, event.logprobs) if (shape.want_logprobs and event) else None
    reason = finish_reason(event.finish_reason) if event and event.finish_reason else None
    if shape.chat:
        delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
        if event is not None and (event.tool_calls or event.reasoning or event.refusal):
            _more_delta(delta, event)
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
    else:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}
    body["choices"] = [choice]
    return body


def usage_chunk(shape: ResponseShape, usage: dict) -> dict:
    body = dict(shape.chunk_head)
    body["choices"] = []
    body["usage"] = usage
    return body


def sse(data: dict) -> bytes:
    return b"data: " + fastjson.dumps(data) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def _logprobs(shape: ResponseShape, items) -> dict:
    if shape.chat:
        return {"content": [_chat_logprob(lp) for lp in items]}
    return {
        "tokens": [lp.token for lp in items],
        "token_logprobs": [lp.logprob for lp in items],
        "top_logprobs": [{t.token: t.logprob for t in lp.top} for lp in items],
        "text_offset": _offsets(items),
    }


def _chat_logprob(lp: TokenLogprob) -> dict:
    return {
        "token": lp.token,
        "logprob": lp.logprob,
        "bytes": list(lp.token.encode()),
        "top_logprobs": [
            {"token": t.token, "logprob": t.logprob, "bytes": list(t.token.encode())} for t in lp.top
        ],
    }


def _offsets(items) -> list[int]:
    offsets, pos = [], 0
    for lp in items:
        offsets.append(pos)
        pos += len(lp.token)
    return offsets
