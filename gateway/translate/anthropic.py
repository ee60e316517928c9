"""Anthropic's Messages API (POST /v1/messages), translated onto chat for every backend.

Request: `model`, `max_tokens` (required), `messages` (user and assistant turns; content a
string or blocks: `text`, `tool_use` in assistant turns, `tool_result` in user turns), `system`
(a string or text blocks), `stop_sequences`, `temperature`, `top_p`, `top_k`, `stream`,
`metadata.user_id`, `tools` (custom tools with an `input_schema`) and `tool_choice` (auto, any,
tool, none; `disable_parallel_tool_use`). Images, documents, thinking, server tools, MCP
servers and containers are refused with a 400 naming the path. `cache_control` is accepted and
ignored (prefix caching here needs no hint).

How turns map: a user turn's tool_result blocks become tool messages (first, since they answer
the calls of the turn before), its text a user message; an assistant turn's tool_use blocks
become its tool_calls (`input` as a JSON string). A tool_result with `is_error` reaches the
model as its text after "Error: ".

Answer: a `message` with a text block (unless the model only called tools) and a tool_use block
per call; `stop_reason` end_turn, max_tokens, tool_use or refusal. Chat completions do not say
which stop string ended a reply, so a stop sequence ends it as end_turn with `stop_sequence`
null. Streamed, Anthropic's events: message_start, ping, per block content_block_start,
content_block_delta (text_delta | input_json_delta) ..., content_block_stop, then
message_delta (stop_reason and the usage) and message_stop; a failure after the start is an
`error` event. Errors are Anthropic's shape, `{"type": "error", "error": {"type", "message"}}`.
POST /v1/messages/count_tokens is the same conversation as a chat-form /tokenize request.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field, model_validator

from gateway.config import RequestLimits
from gateway.errors import APIError, InvalidRequestError
from gateway.protocol.completions import (
    EventWriter, Int, ParsedRequest, Translation, Unsupported, check_message_count)
from gateway.protocol.tokens import ParsedTokenize, parse_tokenize
from gateway.protocol.tools import StrictModel
from gateway.translate.common import (
    chat_request, chat_tool, check_item_counts, chunk_parts, named_event, parse_translated, renamed_error, renames,
    typed, validated)

# ---------------------------------------------------------------------------------- errors

# Anthropic's error types by HTTP status (its docs' table); other statuses are api_error.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error",
               503: "overloaded_error", 504: "timeout_error", 529: "overloaded_error"}


def error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


# ---------------------------------------------------------------------------------- request


class TextBlock(StrictModel):
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None
    citations: list[Any] | None = None


class ToolUseBlock(StrictModel):
    type: Literal["tool_use"]
    id: str = Field(min_length=1, max_length=256)
    name: str = Field(min_length=1, max_length=128)
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolResultBlock(StrictModel):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1, max_length=256)
    content: str | list[Any] | None = None
    is_error: bool | None = None
    cache_control: dict[str, Any] | None = None


class ThinkingBlock(StrictModel):
    """An earlier answer's thinking, sent back: taken, and not sent on (chat templates leave
    earlier turns' reasoning out)."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(StrictModel):
    type: Literal["redacted_thinking"]
    data: str


BLOCKS = {"user": {"text": TextBlock, "tool_result": ToolResultBlock},
          "assistant": {"text": TextBlock, "tool_use": ToolUseBlock, "thinking": ThinkingBlock,
                        "redacted_thinking": RedactedThinkingBlock}}
TEXT_ONLY = {"text": TextBlock}


class MessageParam(StrictModel):
    role: Literal["user", "assistant"]
    content: str | list[Any]


class AnthropicTool(StrictModel):
    type: Literal["custom"] = "custom"
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    input_schema: dict[str, Any]
    strict: bool | None = None
    cache_control: dict[str, Any] | None = None


class AnthropicToolChoice(StrictModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _name_with_tool(self):
        if (self.type == "tool") != (self.name is not None):
            raise ValueError("a tool_choice names a tool exactly when its type is 'tool'")
        return self


class AnthropicMetadata(StrictModel):
    user_id: str | None = Field(None, max_length=512)


class AnthropicThinking(StrictModel):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Int | None = None

    @model_validator(mode="after")
    def _off(self):
        if self.type != "disabled":
            raise Unsupported("thinking", "extended thinking is not supported by this server")
        return self


class MessagesBody(StrictModel):
    model: str = Field(min_length=1)
    max_tokens: Int = Field(ge=1)
    messages: list[Any] = Field(min_length=1)
    system: str | list[Any] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: Int | None = Field(None, ge=0)
    stream: bool = False
    metadata: AnthropicMetadata | None = None
    tools: list[Any] | None = None
    tool_choice: dict[str, Any] | None = None
    cache_salt: Any = None  # vLLM's, not Anthropic's: carried onto the chat request (a vendor field there)
    thinking: AnthropicThinking | None = None
    service_tier: str | None = None  # accepted and ignored: one tier here
    # known, refused unless empty
    container: Any = None
    mcp_servers: list[Any] | None = None
    context_management: Any = None

    @model_validator(mode="after")
    def _unsupported(self):
        for name in ("container", "mcp_servers", "context_management"):
            if getattr(self, name):
                raise Unsupported(name)
        return self


class CountTokensBody(StrictModel):
    """POST /v1/messages/count_tokens: what would be sent, without max_tokens."""

    model: str = Field(min_length=1)
    messages: list[Any] = Field(min_length=1)
    system: str | list[Any] | None = None
    tools: list[Any] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: AnthropicThinking | None = None


RENAMES = renames((r"\bmax_(?:completion_)?tokens\b", "max_tokens"), (r"\bstop\b", "stop_sequences"),
                  (r"(tools\[\d+\])\.function\.parameters\b", r"\1.input_schema"),
                  (r"(tools\[\d+\])\.function\b", r"\1"))


def parse_messages(body: Any, limits: RequestLimits) -> ParsedRequest:
    """An Anthropic Messages request as a chat request that answers in Anthropic's shapes."""
    if not isinstance(body, dict):
        raise InvalidRequestError("The request body must be a JSON object.")
    _check_counts(body.get("messages"), limits)
    req = validated(MessagesBody, body)
    return parse_translated(chat_body(req), limits, RENAMES, AnthropicTranslation(req))


def _check_counts(messages, limits: RequestLimits) -> None:
    """max_messages, then the content blocks across all messages (tool_use ones among them),
    before any of them is validated."""
    if not isinstance(messages, list):
        return
    check_message_count(messages, limits)
    blocks = [b for m in messages if isinstance(m, dict) and isinstance(m.get("content"), list) for b in m["content"]]
    check_item_counts(blocks, limits, "messages", "tool_use")


def parse_count_tokens(body: Any, limits: RequestLimits) -> ParsedTokenize:
    """A count_tokens request as a chat-form /tokenize request (the model's own chat template
    renders the conversation, with the generation prompt, as a generation would)."""
    if not isinstance(body, dict):
        raise InvalidRequestError("The request body must be a JSON object.")
    req = validated(CountTokensBody, body)
    tokenize: dict = {"model": req.model, "messages": _messages(req)}
    if req.tools:
        tokenize["tools"] = [_chat_tool(tool, i) for i, tool in enumerate(req.tools)]
    try:
        return parse_tokenize(tokenize, limits)
    except InvalidRequestError as exc:
        raise renamed_error(exc, RENAMES) from None


def chat_body(req: MessagesBody) -> dict:
    """The chat completions body that asks for what `req` asks."""
    body = chat_request(req.model, _messages(req), req.stream, max_tokens=req.max_tokens,
                        stop=req.stop_sequences or None, temperature=req.temperature, top_p=req.top_p,
                        top_k=req.top_k, user=req.metadata.user_id if req.metadata else None,
                        cache_salt=req.cache_salt)
    if req.tools:
        body["tools"] = [_chat_tool(tool, i) for i, tool in enumerate(req.tools)]
    if req.tool_choice is not None:
        choice = validated(AnthropicToolChoice, req.tool_choice, ("tool_choice",))
        body["tool_choice"] = _chat_tool_choice(choice)
        if choice.disable_parallel_tool_use:
            body["parallel_tool_calls"] = False
    return body


def _messages(req: MessagesBody | CountTokensBody) -> list[dict]:
    out: list[dict] = []
    if req.system is not None:
        system = _text(req.system, ("system",))
        if system:
            out.append({"role": "system", "content": system})
    for i, raw in enumerate(req.messages):
        message = validated(MessageParam, raw, ("messages", i))
        if isinstance(message.content, str):
            out.append({"role": message.role, "content": message.content})
            continue
        at = ("messages", i, "content")
        blocks = [typed(b, (*at, j), BLOCKS[message.role], f"{message.role} content block")
                  for j, b in enumerate(message.content)]
        out += _user_turn(blocks, at) if message.role == "user" else [_assistant_turn(blocks)]
    return out


def _user_turn(blocks: list, at: tuple) -> list[dict]:
    """Tool results first (they answer the turn before), then the user's text."""
    out = [{"role": "tool", "tool_call_id": b.tool_use_id, "content": _result_text(b, (*at, j))}
           for j, b in enumerate(blocks) if isinstance(b, ToolResultBlock)]
    text = "".join(b.text for b in blocks if isinstance(b, TextBlock))
    if text or not out:
        out.append({"role": "user", "content": text})
    return out


def _assistant_turn(blocks: list) -> dict:
    text = "".join(b.text for b in blocks if isinstance(b, TextBlock))
    calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
             for b in blocks if isinstance(b, ToolUseBlock)]
    if not calls:
        return {"role": "assistant", "content": text}
    return {"role": "assistant", "content": text or None, "tool_calls": calls}


def _result_text(block: ToolResultBlock, at: tuple) -> str:
    text = _text(block.content or "", (*at, "content"))
    return f"Error: {text}" if block.is_error else text


def _text(content: str | list, at: tuple) -> str:
    if isinstance(content, str):
        return content
    return "".join(typed(b, (*at, j), TEXT_ONLY, "text block").text for j, b in enumerate(content))


def _chat_tool(tool: Any, i: int) -> dict:
    t = typed(tool, ("tools", i), {"custom": AnthropicTool}, "tool (server tools are not served here)",
              default="custom")
    return chat_tool(t.name, t.input_schema, t.description, t.strict)


def _chat_tool_choice(choice: AnthropicToolChoice) -> str | dict:
    if choice.type == "tool":
        return {"type": "function", "function": {"name": choice.name}}
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


# ---------------------------------------------------------------------------------- answer

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "content_filter": "refusal"}


def stop_reason(finish_reason: str | None, refused: bool = False) -> str:
    """A reply the model refused (chat's `refusal`) ends as a refusal, as Anthropic's do."""
    if refused and finish_reason == "stop":
        return "refusal"
    return STOP_REASONS.get(finish_reason or "", "end_turn")


@dataclass
class AnthropicTranslation(Translation):
    """Turns the chat answer to `request` into the Messages API's (see the module doc)."""

    request: MessagesBody

    def whole(self, shape, chat: dict, states=()) -> dict:
        choice = chat["choices"][0]
        message = choice["message"]
        body = _message(shape, content_blocks(message), usage(chat["usage"]))
        body["stop_reason"] = stop_reason(choice["finish_reason"], bool(message.get("refusal")))
        return body

    def stream(self, shape) -> "AnthropicEvents":
        return AnthropicEvents(shape)


def _message(shape, content: list[dict], usage_: dict) -> dict:
    return {"id": shape.id, "type": "message", "role": "assistant", "model": shape.model, "content": content,
            "stop_reason": None, "stop_sequence": None, "usage": usage_}


def content_blocks(message: dict) -> list[dict]:
    """A whole chat answer's message as blocks: its reasoning as a thinking block, its text and
    refusal as text (unless the model only called tools), then a tool_use block per call."""
    calls = message.get("tool_calls") or []
    text = (message.get("content") or "") + (message.get("refusal") or "")
    blocks = [_thinking(message["reasoning_content"])] if message.get("reasoning_content") else []
    if text or not calls:
        blocks.append({"type": "text", "text": text})
    return blocks + [{"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                      "input": tool_input(c["function"]["arguments"])} for c in calls]


def _thinking(text: str) -> dict:
    # No signature: this server has no way to vouch for thinking sent back (it drops it anyway).
    return {"type": "thinking", "thinking": text, "signature": ""}


def tool_input(arguments: str) -> dict:
    """A call's arguments as the object Anthropic's `input` is. Arguments that are not a JSON
    object (a model's malformed output) are kept whole, under "arguments", not dropped."""
    try:
        value = json.loads(arguments) if arguments else {}
    except ValueError:
        value = None
    return value if isinstance(value, dict) else {"arguments": arguments}


def usage(chat_usage: dict) -> dict:
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": chat_usage["prompt_tokens"], "output_tokens": chat_usage["completion_tokens"],
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


class AnthropicEvents(EventWriter):
    """Chat stream chunks in, Anthropic's stream events out (bytes; b"" while a chunk adds
    nothing). Blocks are sent one after the other, as Anthropic sends them."""

    done = b""  # Anthropic's stream ends with message_stop, no [DONE]

    def __init__(self, shape):
        self.shape = shape
        self.started = False
        self.blocks = 0  # blocks opened so far
        self.open: tuple[str, int] | None = None  # ("text" | "thinking", -1) or ("tool", chat call index)
        self.tool_blocks: dict[int, int] = {}  # chat call index -> block index
        self.finish: str | None = None
        self.refused = False
        self.said = False  # a text or tool_use block was opened (thinking alone says nothing)

    def chunk(self, chunk: dict) -> bytes:
        out = self._start()
        delta, finish, chat_usage = chunk_parts(chunk)
        if delta.get("reasoning_content"):
            out += self._text(delta["reasoning_content"], "thinking")
        if delta.get("content"):
            out += self._text(delta["content"])
        if delta.get("refusal"):
            self.refused = True
            out += self._text(delta["refusal"])
        for call in delta.get("tool_calls") or ():
            out += self._tool(call)
        if finish:
            self.finish = finish
            out += self._text("") if not self.said else []  # an empty reply is one empty text block
            out += self._close()
        if chat_usage is not None:
            final = usage(chat_usage)
            out += [named_event("message_delta", {"type": "message_delta",
                                                  "delta": {"stop_reason": stop_reason(self.finish, self.refused),
                                                            "stop_sequence": None},
                                                  "usage": final}),
                    named_event("message_stop", {"type": "message_stop"})]
        return b"".join(out)

    def error(self, exc: APIError) -> bytes:
        return named_event("error", error_body(exc.status, exc.message))

    def _start(self) -> list[bytes]:
        if self.started:
            return []
        self.started = True
        message = _message(self.shape, [], {"input_tokens": 0, "output_tokens": 0})  # known at the end
        return [named_event("message_start", {"type": "message_start", "message": message}),
                named_event("ping", {"type": "ping"})]

    def _text(self, text: str, kind: str = "text") -> list[bytes]:
        """A piece of a text or thinking block, opening the block as needed."""
        out = []
        if self.open != (kind, -1):
            out += self._close()
            out.append(self._block_start(_thinking("") if kind == "thinking" else {"type": "text", "text": ""}))
            self.open = (kind, -1)
            self.said = self.said or kind == "text"
        if text:
            delta = {"type": "thinking_delta", "thinking": text} if kind == "thinking" else {"type": "text_delta",
                                                                                              "text": text}
            out.append(self._delta(self.blocks - 1, delta))
        return out

    def _tool(self, fragment: dict) -> list[bytes]:
        out = []
        index = fragment.get("index", 0)
        function = fragment.get("function") or {}
        if index not in self.tool_blocks:
            out += self._close()
            block = {"type": "tool_use", "id": fragment.get("id") or "", "name": function.get("name") or "",
                     "input": {}}
            out.append(self._block_start(block))
            self.tool_blocks[index] = self.blocks - 1
            self.open = ("tool", index)
            self.said = True
        if function.get("arguments"):
            # A fragment of a call whose block was already closed (interleaved calls) still goes
            # to that call's block: clients gather deltas by index.
            out.append(self._delta(self.tool_blocks[index],
                                   {"type": "input_json_delta", "partial_json": function["arguments"]}))
        return out

    def _block_start(self, block: dict) -> bytes:
        self.blocks += 1
        return named_event("content_block_start", {"type": "content_block_start", "index": self.blocks - 1,
                                                   "content_block": block})

    def _delta(self, index: int, delta: dict) -> bytes:
        return named_event("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta})

    def _close(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [named_event("content_block_stop", {"type": "content_block_stop", "index": self.blocks - 1})]
