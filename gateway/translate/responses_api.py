"""OpenAI's Responses API (POST /v1/responses), its stateless subset: translated onto chat, or
passed through to deployments that serve it themselves (`ResponsesTranslation.routed`).

Request: `input` (a string, or items: messages, `function_call`, `function_call_output`),
`instructions` (a system message before the input), `max_output_tokens`, `temperature`, `top_p`,
`tools` (function tools, in the Responses' flat shape), `tool_choice`, `parallel_tool_calls`,
`text.format` (text, json_object, json_schema), `stream`, `metadata`, `user`. This server keeps
no responses: `store: true`, `previous_response_id`, `conversation` and `background` are
refused, as are hosted tools and input items of any other type - each a 400 naming its path.

Answer: a `response` object whose output is a message item (one output_text part) unless the
model only called tools, then a function_call item per call. Streamed, it is the Responses
events in their order, each with a rising `sequence_number`:

    response.created, response.in_progress
    per item: response.output_item.added
        message:  response.content_part.added, response.output_text.delta ...,
                  response.output_text.done, response.content_part.done
        call:     response.function_call_arguments.delta ..., response.function_call_arguments.done
              response.output_item.done
    response.completed (response.incomplete when max_output_tokens cut the output)

A failure after the stream started is an `error` event, then `response.failed`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Literal

from pydantic import Field, model_validator

from gateway import fastjson
from gateway.config import RequestLimits
from gateway.errors import APIError, InvalidRequestError
from gateway.protocol.completions import EventWriter, Int, ParsedRequest, Translation, Unsupported
from gateway.protocol.tools import StrictModel
from gateway.translate.common import (
    chat_request, chat_tool, check_item_counts, chunk_parts, named_event, parse_translated, renames, typed, validated)

ID_PREFIX = "resp_"


# ---------------------------------------------------------------------------------- request


class InputText(StrictModel):
    type: Literal["input_text"]
    text: str


class OutputText(StrictModel):
    """Output text a client sends back as part of the conversation (with what came with it)."""

    type: Literal["output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class RefusalPart(StrictModel):
    type: Literal["refusal"]
    refusal: str


PARTS = {"input_text": InputText, "output_text": OutputText, "refusal": RefusalPart}


class MessageItem(StrictModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[Any]
    id: str | None = None
    status: str | None = None


class FunctionCallItem(StrictModel):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=256)
    name: str = Field(min_length=1, max_length=64)
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(StrictModel):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=256)
    output: str | list[Any]
    id: str | None = None
    status: str | None = None


class ReasoningItem(StrictModel):
    """A reasoning item of an earlier answer, sent back: taken, and not sent on (chat templates
    leave earlier turns' reasoning out)."""

    type: Literal["reasoning"]
    summary: list[Any]
    content: list[Any] | None = None
    encrypted_content: str | None = None
    id: str | None = None
    status: str | None = None


ITEMS = {"message": MessageItem, "function_call": FunctionCallItem, "function_call_output": FunctionCallOutputItem,
         "reasoning": ReasoningItem}


class ResponsesFunctionTool(StrictModel):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesNamedFunction(StrictModel):
    type: Literal["function"]
    name: str


class ResponsesTextFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class ResponsesReasoning(StrictModel):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: None = None  # reasoning summaries are not made here


class ResponsesTextConfig(StrictModel):
    format: ResponsesTextFormat | None = None


class ResponsesBody(StrictModel):
    model: str = Field(min_length=1)
    input: str | list[Any]
    instructions: str | None = None
    max_output_tokens: Int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool = False
    stream_options: dict[str, Any] | None = None  # include_obfuscation: nothing here to pad
    store: bool | None = None
    tools: list[Any] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: ResponsesTextConfig | None = None
    truncation: Literal["disabled"] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = Field(None, max_length=512)
    cache_salt: Any = None  # vLLM's (its Responses API takes it too): checked as chat's vendor field
    # accepted and ignored: they do not change the output
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # known, refused unless empty or off
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None
    include: list[str] | None = None
    reasoning: ResponsesReasoning | None = None
    prompt: Any = None
    max_tool_calls: Int | None = None
    top_logprobs: Int | None = None

    @model_validator(mode="after")
    def _stateless(self):
        stateless = "this server keeps no responses: send the whole conversation in 'input'"
        if self.store:
            raise Unsupported("store", f"store: true is not supported ({stateless}, with store: false)")
        for name in ("previous_response_id", "conversation"):
            if getattr(self, name) is not None:
                raise Unsupported(name, f"'{name}' is not supported ({stateless})")
        if self.background:
            raise Unsupported("background")
        if self.include:
            raise Unsupported("include")
        for name in ("prompt", "max_tool_calls", "top_logprobs"):
            if getattr(self, name) is not None:
                raise Unsupported(name)
        return self


# What a chat refusal names, in this API's terms.
RENAMES = renames((r"\bmax_(?:completion_)?tokens\b", "max_output_tokens"), (r"\bmessages\b", "input"),
                  (r"\breasoning_effort\b", "reasoning.effort"),
                  (r"\bresponse_format\b", "text.format"), (r"(tools\[\d+\])\.function\b", r"\1"))


def parse_responses(body: Any, limits: RequestLimits) -> ParsedRequest:
    """A Responses request as a chat request that answers in Responses' shapes."""
    raw = body.get("input") if isinstance(body, dict) else None
    if isinstance(raw, list):
        check_item_counts(raw, limits, "input", "function_call")
    req = validated(ResponsesBody, body) if isinstance(body, dict) else _not_an_object()
    items = _input_items(req.input)
    chat = chat_body(req, items)
    return parse_translated(chat, limits, RENAMES, ResponsesTranslation(req))


def _not_an_object():
    raise InvalidRequestError("The request body must be a JSON object.")


def _input_items(value: str | list) -> list:
    if isinstance(value, str):
        return [MessageItem(role="user", content=value)]
    if not value:
        raise InvalidRequestError("'input' must not be empty.", param="input")
    return [typed(item, ("input", i), ITEMS, "input item", default="message") for i, item in enumerate(value)]


def chat_body(req: ResponsesBody, items: list) -> dict:
    """The chat completions body that asks for what `req` asks."""
    body = chat_request(req.model, _messages(req.instructions, items), req.stream,
                        max_completion_tokens=req.max_output_tokens, temperature=req.temperature, top_p=req.top_p,
                        user=req.user, parallel_tool_calls=req.parallel_tool_calls,
                        reasoning_effort=req.reasoning.effort if req.reasoning else None,
                        cache_salt=req.cache_salt)
    if req.tools:
        body["tools"] = [_chat_tool(tool, i) for i, tool in enumerate(req.tools)]
    if req.tool_choice is not None:
        body["tool_choice"] = _chat_tool_choice(req.tool_choice)
    if req.text is not None and req.text.format is not None and req.text.format.type != "text":
        body["response_format"] = _chat_response_format(req.text.format)
    return body


def _messages(instructions: str | None, items: list) -> list[dict]:
    out: list[dict] = [{"role": "system", "content": instructions}] if instructions is not None else []
    for i, item in enumerate(items):
        if isinstance(item, MessageItem):
            out.append({"role": item.role, "content": _text(item.content, ("input", i, "content"))})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":  # calls made in the same turn
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            out.append({"role": "tool", "tool_call_id": item.call_id,
                        "content": _text(item.output, ("input", i, "output"))})
    return out


def _text(content: str | list, at: tuple) -> str:
    if isinstance(content, str):
        return content
    parts = [typed(part, (*at, j), PARTS, "content part") for j, part in enumerate(content)]
    return "".join(p.refusal if isinstance(p, RefusalPart) else p.text for p in parts)


def _chat_tool(tool: Any, i: int) -> dict:
    t = typed(tool, ("tools", i), {"function": ResponsesFunctionTool}, "tool")
    return chat_tool(t.name, t.parameters, t.description, t.strict)


def _chat_tool_choice(choice: str | dict) -> str | dict:
    if isinstance(choice, str):
        return choice
    named = typed(choice, ("tool_choice",), {"function": ResponsesNamedFunction}, "tool_choice")
    return {"type": "function", "function": {"name": named.name}}


def _chat_response_format(fmt: ResponsesTextFormat) -> dict:
    if fmt.type == "json_object":
        return {"type": "json_object"}
    schema = {"name": fmt.name, "schema": fmt.json_schema, "description": fmt.description, "strict": fmt.strict}
    return {"type": "json_schema", "json_schema": {k: v for k, v in schema.items() if v is not None}}


# ---------------------------------------------------------------------------------- answer


@dataclass
class ResponsesTranslation(Translation):
    """Turns the chat answer to `request` into the Responses API's (see the module doc)."""

    request: ResponsesBody

    def routed(self, parsed: ParsedRequest, declared: list) -> ParsedRequest:
        """Passed through as it came when a deployment of the model serves the Responses API
        itself, with all this request needs (`declared`: each deployment's name and
        capabilities); else translated onto chat, as parsed."""
        needs = replace(parsed.needs, endpoint="responses", extras=frozenset())
        if not any(caps.serves(needs) for _, caps in declared):
            return parsed
        body = self.request.model_dump(by_alias=True, exclude_unset=True)
        return replace(parsed, needs=needs, passthrough=body, include_usage=False,
                       translation=PassedThrough(self.request))

    def whole(self, shape, chat: dict, states=()) -> dict:
        choice = chat["choices"][0]
        output = output_items(shape.id, choice["message"], _item_status(choice["finish_reason"]))
        return response_object(self.request, shape, output, chat["usage"], choice["finish_reason"])

    def stream(self, shape) -> "ResponsesEvents":
        return ResponsesEvents(self.request, shape)


@dataclass
class PassedThrough(Translation):
    """The answer of a deployment that serves the Responses API itself: relayed as it came
    (`TokenEvent.raw`), its id and events the upstream's."""

    request: ResponsesBody

    def whole(self, shape, chat: dict, states) -> dict:
        raw = b"".join(states[0].raw) if states else b""
        if not raw:  # it ended without an answer (aborted): say what the chat side knows
            return ResponsesTranslation(self.request).whole(shape, chat)
        return fastjson.loads(raw)

    def stream(self, shape) -> "ResponsesEvents":
        return _Relay(self.request, shape)


def output_items(response_id: str, message: dict, status: str = "completed") -> list[dict]:
    """A whole chat answer's message as output items: its reasoning, its text and refusal (a
    message, unless the model only called tools), then one function_call item per call."""
    items = []
    if message.get("reasoning_content"):
        reasoning = [_part("reasoning_text", message["reasoning_content"])]
        items.append(_item("reasoning", response_id, len(items), reasoning))
    calls = message.get("tool_calls") or []
    parts = [_part(kind, message[field]) for kind, field in (("output_text", "content"), ("refusal", "refusal"))
             if message.get(field)]
    if parts or not calls:
        items.append(_item("message", response_id, len(items), parts or [_part("output_text", "")], status))
    items += [_call_item(response_id, len(items) + i, c["id"], c["function"]["name"], c["function"]["arguments"])
              for i, c in enumerate(calls)]
    return items


ID_PREFIXES = {"message": "msg", "reasoning": "rs", "function_call": "fc"}


def _item(kind: str, response_id: str, output_index: int, content: list[dict], status: str = "completed") -> dict:
    item = {"id": _item_id(kind, response_id, output_index), "type": kind, "status": status, "content": content}
    if kind == "message":
        item["role"] = "assistant"
    else:
        item["summary"] = []
    return item


def _item_id(kind: str, response_id: str, output_index: int) -> str:
    return f"{ID_PREFIXES[kind]}_{response_id.removeprefix(ID_PREFIX)}_{output_index}"


def _part(kind: str, text: str) -> dict:
    """A content part: output_text, refusal or reasoning_text."""
    if kind == "output_text":
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    if kind == "refusal":
        return {"type": "refusal", "refusal": text}
    return {"type": kind, "text": text}


def _item_status(finish_reason: str | None) -> str:
    """A message cut by max_output_tokens is incomplete, as the response is."""
    return "incomplete" if finish_reason == "length" else "completed"


def _call_item(response_id: str, output_index: int, call_id: str, name: str, arguments: str,
               status: str = "completed") -> dict:
    return {"id": _item_id("function_call", response_id, output_index), "type": "function_call", "status": status,
            "call_id": call_id, "name": name, "arguments": arguments}


def response_object(req: ResponsesBody, shape, output: list[dict], usage: dict | None, finish: str | None,
                    status: str | None = None, error: dict | None = None) -> dict:
    """The `response` object: its state, output and usage, and the settings it ran with."""
    incomplete = {"length": "max_output_tokens", "content_filter": "content_filter"}.get(finish or "")
    if status is None:
        status = "incomplete" if incomplete else "completed"
    fmt = req.text.format if req.text is not None and req.text.format is not None else ResponsesTextFormat(type="text")
    return {
        "id": shape.id, "object": "response", "created_at": shape.created, "status": status, "error": error,
        "incomplete_details": {"reason": incomplete} if incomplete and status == "incomplete" else None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": shape.model,
        "output": output, "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": None, "store": False,
        "reasoning": req.reasoning.model_dump() if req.reasoning else None,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True)},
        "tool_choice": req.tool_choice or "auto", "tools": req.tools or [],
        "top_p": 1.0 if req.top_p is None else req.top_p, "truncation": "disabled",
        "usage": _usage(usage) if usage is not None else None, "user": req.user, "metadata": req.metadata or {},
        "background": False,
    }


def _usage(usage: dict) -> dict:
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    reasoning = (usage.get("completion_tokens_details") or {}).get("reasoning_tokens", 0)
    details = {"cached_tokens": cached, "cache_write_tokens": 0}
    return {"input_tokens": usage["prompt_tokens"], "input_tokens_details": details,
            "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": usage["total_tokens"]}


def _failure_code(exc: APIError) -> str:
    """A failed response's error code, from the few the Responses API defines (the `error`
    event before it carries this server's own code)."""
    return "rate_limit_exceeded" if exc.status == 429 else "server_error"


@dataclass
class _OpenItem:
    """An output item being streamed: where it sits in the output, and what it holds so far: a
    message's or a reasoning item's parts ((kind, text pieces) each, the last one open), or a
    call's argument pieces."""

    output_index: int
    item: dict
    parts: list[tuple[str, list[str]]] = field(default_factory=list)
    arguments: list[str] = field(default_factory=list)


# The events of each part kind: "<prefix>.delta" and "<prefix>.done", and the done event's field.
PART_EVENTS = {"output_text": ("response.output_text", "text"), "refusal": ("response.refusal", "refusal"),
               "reasoning_text": ("response.reasoning_text", "text")}


class ResponsesEvents(EventWriter):
    """Chat stream chunks in, Responses events out (bytes; b"" while a chunk adds nothing).
    One reasoning or message item is open at a time; function calls stay open until the end
    (their fragments may interleave)."""

    done = b""  # the Responses stream has no [DONE]

    def __init__(self, request: ResponsesBody, shape):
        self.request, self.shape = request, shape
        self.sequence = 0
        self.started = False
        self.output: list[dict] = []  # every item opened, in output order (final once closed)
        self.current: _OpenItem | None = None  # the open reasoning or message item
        self.calls: dict[int, _OpenItem] = {}  # by the chat stream's tool call index
        self.finish: str | None = None

    def chunk(self, chunk: dict) -> bytes:
        out = self._start()
        delta, finish, usage = chunk_parts(chunk)
        for field_name, item, part in (("reasoning_content", "reasoning", "reasoning_text"),
                                       ("content", "message", "output_text"), ("refusal", "message", "refusal")):
            if delta.get(field_name):
                out += self._piece(item, part, delta[field_name])
        for call in delta.get("tool_calls") or ():
            out += self._call(call)
        if finish:
            self.finish = finish
            out += self._close_all()
        if usage is not None:
            response = response_object(self.request, self.shape, self.output, usage, self.finish)
            kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
            out.append(self._event(kind, response=response))
        return b"".join(out)

    def error(self, exc: APIError) -> bytes:
        out = self._start()
        out.append(self._event("error", code=exc.code, message=exc.message, param=exc.param))
        failed = response_object(self.request, self.shape, self.output, None, None, status="failed",
                                 error={"code": _failure_code(exc), "message": exc.message})
        out.append(self._event("response.failed", response=failed))
        return b"".join(out)

    def _event(self, kind: str, **fields) -> bytes:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return named_event(kind, data)

    def _start(self) -> list[bytes]:
        if self.started:
            return []
        self.started = True
        snapshot = response_object(self.request, self.shape, [], None, None, status="in_progress")
        return [self._event("response.created", response=snapshot),
                self._event("response.in_progress", response=snapshot)]

    def _open(self, item: dict) -> tuple[_OpenItem, bytes]:
        opened = _OpenItem(len(self.output), item)
        self.output.append(item)
        return opened, self._event("response.output_item.added", output_index=opened.output_index, item=item)

    def _at(self, opened: _OpenItem) -> dict:
        return {"item_id": opened.item["id"], "output_index": opened.output_index}

    def _piece(self, kind: str, part: str, text: str) -> list[bytes]:
        """A piece of a reasoning or message item's part, opening the item and the part as needed."""
        out = []
        current = self.current
        if current is None or current.item["type"] != kind:
            out += self._close_current() + self._close_calls()
            current = self.current = self._open_item(kind, out)
        if not current.parts or current.parts[-1][0] != part:
            out += self._close_part(current)
            current.parts.append((part, []))
            out.append(self._event("response.content_part.added", **self._at(current),
                                   content_index=len(current.parts) - 1, part=_part(part, "")))
        if text:
            current.parts[-1][1].append(text)
            prefix, _ = PART_EVENTS[part]
            extra = {"logprobs": []} if part == "output_text" else {}
            out.append(self._event(f"{prefix}.delta", **self._at(current), content_index=len(current.parts) - 1,
                                   delta=text, **extra))
        return out

    def _open_item(self, kind: str, out: list[bytes]) -> _OpenItem:
        item = _item(kind, self.shape.id, len(self.output), [], status="in_progress")
        opened, added = self._open(item)
        out.append(added)
        return opened

    def _close_part(self, current: _OpenItem) -> list[bytes]:
        if not current.parts:
            return []
        part, pieces = current.parts[-1]
        text = "".join(pieces)
        prefix, field_name = PART_EVENTS[part]
        index = len(current.parts) - 1
        extra = {"logprobs": []} if part == "output_text" else {}
        done = {field_name: text, **extra}
        return [self._event(f"{prefix}.done", **self._at(current), content_index=index, **done),
                self._event("response.content_part.done", **self._at(current), content_index=index,
                            part=_part(part, text))]

    def _close_current(self) -> list[bytes]:
        current, self.current = self.current, None
        if current is None:
            return []
        out = self._close_part(current)
        status = _item_status(self.finish) if current.item["type"] == "message" else "completed"
        current.item.update(status=status, content=[_part(part, "".join(pieces)) for part, pieces in current.parts])
        out.append(self._event("response.output_item.done", output_index=current.output_index, item=current.item))
        return out

    def _call(self, fragment: dict) -> list[bytes]:
        out = []
        index = fragment.get("index", 0)
        function = fragment.get("function") or {}
        call = self.calls.get(index)
        if call is None:
            out += self._close_current()
            item = _call_item(self.shape.id, len(self.output), fragment.get("id") or "", function.get("name") or "",
                              "", status="in_progress")
            call, added = self._open(item)
            self.calls[index] = call
            out.append(added)
        if function.get("arguments"):
            call.arguments.append(function["arguments"])
            out.append(self._event("response.function_call_arguments.delta", **self._at(call),
                                   delta=function["arguments"]))
        return out

    def _close_calls(self) -> list[bytes]:
        out = []
        for call in sorted(self.calls.values(), key=lambda c: c.output_index):
            arguments = "".join(call.arguments)
            call.item.update(status="completed", arguments=arguments)
            out += [self._event("response.function_call_arguments.done", **self._at(call), arguments=arguments,
                                name=call.item["name"]),
                    self._event("response.output_item.done", output_index=call.output_index, item=call.item)]
        self.calls = {}
        return out

    def _close_all(self) -> list[bytes]:
        out = []
        if not any(item["type"] != "reasoning" for item in self.output):
            out += self._piece("message", "output_text", "")  # nothing said: one empty message, as a whole answer has
        return out + self._close_current() + self._close_calls()


class _Relay(ResponsesEvents):
    """A passed-through stream: the upstream's events go as they came (`TokenEvent.raw`), so
    only a failure of this gateway's own (the upstream dropped mid-stream) is written here."""

    def __init__(self, request: ResponsesBody, shape):
        super().__init__(request, shape)
        self.started = True  # the upstream sent response.created

    def chunk(self, chunk: dict) -> bytes:
        return b""
