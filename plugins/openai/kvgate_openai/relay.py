"""Answers of an upstream that serves the client's own API (the Responses API: a request with
`passthrough`), relayed as they came: each SSE event re-sent whole in `TokenEvent.raw`, with
what the gateway's books need read from it (the output text, the end and its usage).

    upstream ──SSE──> SSEDecoder ──payload──> stream_event ──> TokenEvent(raw=the event, text=
                                                               its text delta; at the end the
                                                               finish reason and usage)
"""

from __future__ import annotations

from gateway import fastjson
from gateway.backend import TokenEvent, Usage
from kvgate_openai.counts import token_count

PATHS = {"responses": "/responses"}  # the upstream path of each API passed through
# The events that end a Responses stream, each carrying the final response object.
ENDS = ("response.completed", "response.incomplete", "response.failed")


def stream_event(payload: bytes) -> TokenEvent:
    """One upstream event as it came (ValueError when it is not a typed JSON object)."""
    data = fastjson.loads(payload)
    kind = data.get("type") if isinstance(data, dict) else None
    if not isinstance(kind, str) or not kind.isprintable() or "\n" in kind:
        raise ValueError("a stream event without a type")
    raw = b"event: " + kind.encode() + b"\ndata: " + payload + b"\n\n"
    if kind == "response.output_text.delta":
        return TokenEvent(text=str(data.get("delta") or ""), raw=raw)
    if kind in ENDS:
        response = data.get("response") or {}
        return TokenEvent(raw=raw, finish_reason=finish_of(response), usage=usage_of(response))
    return TokenEvent(raw=raw)


def is_error(event: TokenEvent) -> bool:
    """An `error` event: the upstream failed mid-stream and said so (response.failed may follow,
    or the stream just ends)."""
    return event.raw.startswith(b"event: error\n")


def whole_event(body: dict, raw: bytes) -> TokenEvent:
    """A whole (non-streamed) response object, relayed as the bytes it came in."""
    text = "".join(part.get("text") or "" for item in body.get("output") or () if item.get("type") == "message"
                   for part in item.get("content") or () if part.get("type") == "output_text")
    return TokenEvent(text=text, raw=raw, finish_reason=finish_of(body), usage=usage_of(body))


def finish_of(response: dict) -> str:
    if response.get("status") == "incomplete":
        return "length"
    if any(item.get("type") == "function_call" for item in response.get("output") or ()):
        return "tool_calls"
    return "stop"


def usage_of(response: dict) -> Usage:
    """The usage; ValueError naming a count that is not one (see wire.usage_of)."""
    usage = response.get("usage") or {}
    details = usage.get("input_tokens_details") or {}
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return Usage(token_count(usage, "input_tokens"), token_count(usage, "output_tokens"),
                 token_count({"cached_tokens": cached}, "cached_tokens"))
