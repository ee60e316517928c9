"""OpenAI response bodies and stream chunks, built from backend token events."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import cached_property

from gateway import fastjson
from gateway.backend import TokenEvent, TokenLogprob, Usage


@dataclass
class ChoiceState:
    """What one choice has produced so far (non-streaming answers are built from it)."""

    index: int
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    usage: Usage | None = None

    def add(self, event: TokenEvent) -> None:
        if event.text:
            self.text.append(event.text)
        self.logprobs.extend(event.logprobs)
        if event.finish_reason:
            self.finish_reason = event.finish_reason
        if event.usage:
            self.usage = event.usage


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
    # "abort" is internal; a client only sees a choice end as stop or length.
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
            "message": {"role": "assistant", "content": text},
            "logprobs": logprobs,
            "finish_reason": finish_reason(c.finish_reason),
        }
    return {"index": c.index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason(c.finish_reason)}


def stream_chunk(shape: ResponseShape, index: int, event: TokenEvent | None, first: bool) -> dict:
    """One SSE chunk for one choice. `event` None with `first` sends the chat role opener.
    (Runs per token: the head is copied from the shape, finish_reason() runs only at the end.)"""
    body = dict(shape.chunk_head)
    text = event.text if event else ""
    logprobs = _logprobs(shape, event.logprobs) if (shape.want_logprobs and event) else None
    reason = finish_reason(event.finish_reason) if event and event.finish_reason else None
    if shape.chat:
        delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
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
