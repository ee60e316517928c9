"""What the translation tests share: chat stream chunks to feed a translation, and its named
SSE events read back, each checked against the SDK's own class for its type."""

from __future__ import annotations

import json
from typing import get_args

from gateway.protocol.bodies import ResponseShape


def sdk_event_types(union) -> dict[str, type]:
    """The SDK's class of each event type, from its (annotated) union of event classes."""
    return {get_args(c.model_fields["type"].annotation)[0]: c for c in get_args(get_args(union)[0])}


def named_events(raw: bytes, event_types: dict[str, type]) -> list[dict]:
    """The data of each event; its `event:` line names its type, and an event of a type the SDK
    has validates as that class (every field it requires is there)."""
    out = []
    for block in raw.decode().split("\n\n"):
        if block:
            name, data = block.split("\n")
            payload = json.loads(data.removeprefix("data: "))
            assert name == f"event: {payload['type']}"
            if payload["type"] in event_types:
                event_types[payload["type"]].model_validate(payload)
            out.append(payload)
    return out


def shape(response_id: str) -> ResponseShape:
    return ResponseShape(chat=True, id=response_id, model="m", created=1)


def chunk(delta: dict | None = None, finish: str | None = None) -> dict:
    return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta or {}, "finish_reason": finish}]}


def usage_chunk(prompt: int = 3, completion: int = 2) -> dict:
    return {"choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                                     "total_tokens": prompt + completion}}
