"""What the translations share: named SSE events, validation at a path, and running the
translated chat body through the chat request checks with the refusal renamed."""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

from pydantic import BaseModel, ValidationError

from gateway import fastjson
from gateway.config import RequestLimits, format_path
from gateway.errors import InvalidRequestError
from gateway.protocol.completions import ParsedRequest, to_api_error, parse_chat


Renames = list[tuple[re.Pattern, str]]


def named_event(name: str, data: dict) -> bytes:
    """One SSE event with an `event:` line (both APIs name each event by its `type`)."""
    return b"event: " + name.encode() + b"\ndata: " + fastjson.dumps(data) + b"\n\n"


def validated(model: type[BaseModel], value: Any, at: tuple = ()):
    """`model` from `value`, which sits at path `at` of the body: a 400 names the whole path."""
    if at and not isinstance(value, dict):
        raise InvalidRequestError(f"Invalid value for '{format_path(at)}': expected an object.", param=format_path(at))
    try:
        return model.model_validate(value)
    except ValidationError as exc:
        raise to_api_error(exc, at) from None


def typed(value: Any, at: tuple, models: dict[str, type[BaseModel]], what: str, default: str | None = None):
    """`value` validated by the model of its `type` (`default` when it has none); a type this
    server does not take is a 400 naming `<at>.type` and the types it takes."""
    kind = value.get("type", default) if isinstance(value, dict) else None
    model = models.get(kind) if isinstance(kind, str) else None
    if model is None and isinstance(value, dict):
        where = format_path((*at, "type"))
        shown = repr(kind)[:64]
        raise InvalidRequestError(f"Invalid value for '{where}': {shown} is not a {what} this server takes "
                                  f"(it takes: {', '.join(models)}).", param=where)
    return validated(model, value, at)


def chat_request(model: str, messages: list[dict], stream: bool, **fields) -> dict:
    """A chat completions body with the `fields` that are set (None: left out). A stream asks
    for its usage: the translated stream ends with it (response.completed, message_delta)."""
    body = {"model": model, "messages": messages, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    body.update((name, value) for name, value in fields.items() if value is not None)
    return body


def chat_tool(name: str, parameters: dict | None = None, description: str | None = None,
              strict: bool | None = None) -> dict:
    """A function tool in chat's shape, with the fields that are set."""
    function = {"name": name}
    for key, value in (("description", description), ("parameters", parameters), ("strict", strict)):
        if value is not None:
            function[key] = value
    return {"type": "function", "function": function}


def chunk_parts(chunk: dict) -> tuple[dict, str | None, dict | None]:
    """(delta, finish_reason, usage) of a chat stream chunk of one choice: the usage chunk has
    no choices, the others no usage."""
    choices = chunk.get("choices")
    if choices:
        return choices[0].get("delta") or {}, choices[0].get("finish_reason"), None
    return {}, None, chunk.get("usage")


def check_item_counts(items: list, limits: RequestLimits, param: str, calls_kind: str) -> None:
    """Before any item is validated: at most max_input_items of them, and at most max_tool_calls of
    `calls_kind` (Responses function_call items, Anthropic tool_use blocks). Thousands of them
    become one chat message, which max_messages does not count, after each was validated alone."""
    if len(items) > limits.max_input_items:
        raise InvalidRequestError(f"{len(items)} input items, over this server's limit of {limits.max_input_items}.",
                                  param=param)
    calls = sum(1 for item in items if isinstance(item, dict) and item.get("type") == calls_kind)
    if calls > limits.max_tool_calls:
        raise InvalidRequestError(f"{calls} {calls_kind} items, over this server's limit of {limits.max_tool_calls} "
                                  "tool calls.", param=param)


def parse_translated(chat_body: dict, limits: RequestLimits, renamed: Renames, translation) -> ParsedRequest:
    """The translated chat body checked as a chat request (limits, tools, formats), carrying
    `translation` (what turns the chat answer back into the client's API); a refusal that names
    a chat parameter names the client's own instead."""
    try:
        parsed = parse_chat(chat_body, limits)
    except InvalidRequestError as exc:
        raise renamed_error(exc, renamed) from None
    return replace(parsed, translation=translation)


def renames(*pairs: tuple[str, str]) -> Renames:
    """(regex over a chat parameter path, the client API's path) pairs, compiled."""
    return [(re.compile(pattern), theirs) for pattern, theirs in pairs]


def renamed_error(exc: InvalidRequestError, renamed: Renames) -> InvalidRequestError:
    """`exc` naming the client API's parameters instead of chat's."""
    message, param = exc.message, exc.param
    for pattern, theirs in renamed:
        message = pattern.sub(theirs, message)
        if param is not None:
            param = pattern.sub(theirs, param)
    return type(exc)(message, param=param, code=exc.code)
