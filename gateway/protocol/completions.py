"""OpenAI request bodies: validated, then turned into what backends need.

Parameters fall in these groups, and none is silently misread:
- supported: mapped onto `SamplingParams`;
- chat features a backend may lack (`tools`, `tool_choice`, `parallel_tool_calls`,
  `response_format` json_object / json_schema, `reasoning_effort`, logprobs, n): validated here
  (protocol/tools.py), carried typed on the request, and routed only to deployments that declared
  them (gateway.capabilities); a model none of whose deployments has one answers 400;
- accepted and ignored, because they do not change the output: `user` (passed to the backend
  for its logs), `metadata`, `store`, `service_tier`;
- known but unsupported (`functions`, `logit_bias`, `suffix`, `echo`, `best_of` > n, audio):
  rejected with a 400 naming the parameter;
- anything else is a vendor field (`extra`): bounded in number and size here, forwarded verbatim
  to a deployment that declared it accepts that field, and otherwise rejected as an
  unrecognized argument, the way OpenAI does.
vLLM-style extensions are supported: `top_k`, `min_p`, `repetition_penalty`, `ignore_eos`,
`stop_token_ids`.

Every number is bounded to what every backend can represent (seeds are unsigned 63-bit, token
ids and top_k signed 32-bit, floats finite), and a request's total work by `server.limits`
(prompts, choices, token ids, stop criteria), so no value can reach an engine that would fail
there for everyone.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Annotated, Any, Literal, Protocol, Sequence, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator

from gateway import fastjson
from gateway.backend import TRANSFER_PARAMS, SamplingParams
from gateway.capabilities import Capabilities, Needs
from gateway.config import RequestLimits, format_path
from gateway.errors import APIError, InvalidRequestError
from gateway.protocol.bodies import ChoiceState, ResponseShape
from gateway.protocol.tools import (
    FunctionTool, ResponseFormat, StrictModel, ToolCall, ToolChoice, check_response_format, check_tools)

IGNORED = ("metadata", "store", "service_tier")
EXTRA_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,63}$")
# Fields that tell an engine where to read or send a prompt's KV (vLLM's P/D params, SGLang's
# bootstrap): only the gateway sets them (gateway.dispatch.disagg). A client's are dropped, never
# forwarded: forged ones would point an engine at another request's blocks or another host.
ENGINE_ONLY_FIELDS = frozenset({TRANSFER_PARAMS, "bootstrap_host", "bootstrap_port", "bootstrap_room"})
# Vendor fields whose type the gateway knows (vLLM's extensions a backend here reads itself): a
# wrong one is the client's 400 naming it, whichever deployment would have taken the field.
TYPED_EXTRAS = {"skip_special_tokens": (bool, "a boolean"), "cache_salt": (str, "a non-empty string")}
CACHE_SALT = "cache_salt"  # vLLM's: the prompt's blocks hash apart from other salts' (no shared prefix)
RESERVED_SALT_PREFIX = "kvgate."  # the gateway's tenant salts (gateway.keys.store.tenant_salt)
REASONING_EFFORTS = Literal["none", "minimal", "low", "medium", "high", "xhigh"]

MAX_SEED = 2**63 - 1  # int64 (OpenAI, vLLM) and uint64 (TensorRT-LLM) both hold [0, 2**63)
MAX_INT32 = 2**31 - 1  # token ids and top_k, as engines index them
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for completions


def _integral_float(value: Any) -> Any:
    """JSON has one number type, and JSON Schema counts 2.0 as an integer: take it as 2. Fractions,
    infinities and booleans still fail the strict int check that follows."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


Int = Annotated[int, BeforeValidator(_integral_float)]
TokenId = Annotated[int, Field(ge=0, le=MAX_INT32), BeforeValidator(_integral_float)]
MaxTokens = Annotated[int, Field(ge=1), BeforeValidator(_integral_float)]  # max_tokens, max_completion_tokens


class StreamOptions(StrictModel):
    include_usage: bool = False
    # vLLM's extension (GuideLLM sends it): usage in every chunk, not only in the last one.
    # As in vLLM it takes effect with include_usage.
    continuous_usage_stats: bool = False


class _Common(StrictModel):
    # Unknown top-level fields are vendor fields (`model_extra`), checked by `vendor_extras`.
    model_config = ConfigDict(extra="allow", strict=True)

    model: str = Field(min_length=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: Int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    seed: Int | None = Field(None, ge=0, le=MAX_SEED)
    user: str | None = Field(None, max_length=512)
    # vLLM-style extensions
    top_k: Int | None = Field(None, ge=-1, le=MAX_INT32)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, ge=0.01, le=10)
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    # accepted, ignored (they do not change the output)
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    # known, unsupported unless empty
    logit_bias: dict[str, Any] | None = None
    functions: list[Any] | None = None
    function_call: Any = None

    @model_validator(mode="after")
    def _unsupported(self):
        for name in ("logit_bias", "functions"):
            if getattr(self, name):
                raise Unsupported(name)
        if self.function_call not in (None, "none"):
            raise Unsupported("function_call")
        return self

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionBody(_Common):
    prompt: Union[str, list[str], list[TokenId], list[list[TokenId]]]
    max_tokens: MaxTokens | None = DEFAULT_COMPLETION_TOKENS
    logprobs: Int | None = Field(None, ge=0)
    echo: bool = False
    best_of: Int | None = Field(None, ge=1)
    suffix: str | None = None

    @model_validator(mode="after")
    def _completion_unsupported(self):
        if self.echo:
            raise Unsupported("echo")
        if self.suffix:
            raise Unsupported("suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise Unsupported("best_of", "best_of other than n is not supported")
        return self


class ContentPart(StrictModel):
    type: Literal["text"]
    text: str


class Message(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant: the calls it made
    tool_call_id: str | None = Field(None, min_length=1, max_length=256)  # tool: the call this answers
    refusal: str | None = None  # assistant: a refusal it gave

    @model_validator(mode="after")
    def _content_required(self):
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs tool_call_id (the id of the call it answers)")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError("only a tool message has tool_call_id")
        if (self.tool_calls is not None or self.refusal is not None) and self.role != "assistant":
            raise ValueError("only an assistant message has tool_calls or refusal")
        return self

    @property
    def uses_tools(self) -> bool:
        return self.role == "tool" or bool(self.tool_calls)


class ChatBody(_Common):
    messages: list[Message] = Field(min_length=1)
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool = False
    top_logprobs: Int | None = Field(None, ge=0)
    tools: list[FunctionTool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    reasoning_effort: REASONING_EFFORTS | None = None
    modalities: list[Literal["text"]] | None = None
    audio: Any = None

    @model_validator(mode="after")
    def _chat_rules(self):
        if self.audio is not None:
            raise Unsupported("audio")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self


class Unsupported(ValueError):
    def __init__(self, param: str, message: str | None = None):
        super().__init__(message or f"'{param}' is not supported by this server")
        self.param = param


class EventWriter(Protocol):
    """A stream's bytes in the client's API: one chunk's event(s), an error's, and the end."""

    done: bytes

    def chunk(self, chunk: dict) -> bytes: ...

    def error(self, exc: APIError) -> bytes: ...


class Translation(Protocol):
    """Another API's request answered through chat completions (gateway.translate): it turns the
    chat answer into that API's answer. The translations subclass it."""

    def routed(self, parsed: ParsedRequest, declared: list[tuple[str, Capabilities]]) -> ParsedRequest:
        """The request as it goes to the pool, given what each of its deployments declares
        (name, capabilities): passed through where one serves that API itself. Default: as parsed."""
        return parsed

    def whole(self, shape: ResponseShape, chat: dict, states: Sequence[ChoiceState] = ()) -> dict:
        """The whole answer in that API, from the chat answer (and the choices' states)."""
        ...

    def stream(self, shape: ResponseShape) -> EventWriter:
        """The writer of a stream's events in that API."""
        ...


@dataclass
class ParsedRequest:
    """A validated request: what to run, how many choices, and how to answer."""

    chat: bool
    model: str
    sampling: SamplingParams
    n: int
    stream: bool
    include_usage: bool
    continuous_usage: bool = False  # usage in every stream chunk (stream_options.continuous_usage_stats)
    prompts: list[str | list[int]] | None = None  # completions: one entry per prompt
    messages: list[dict] | None = None  # chat
    user: str | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict | None = None
    reasoning_effort: str | None = None
    extra: dict[str, Any] | None = None  # vendor fields, verbatim
    needs: Needs = Needs("chat")
    # Set when the request came in another API's shape (gateway.translate): it turns the chat
    # answer into that API's answer.
    translation: Translation | None = None
    passthrough: dict | None = None  # the client's own body, for a backend that serves its API itself

    @property
    def num_choices(self) -> int:
        return self.n * (len(self.prompts) if self.prompts is not None else 1)


def parse_completion(body: Any, limits: RequestLimits) -> ParsedRequest:
    req = validate_body(CompletionBody, body)
    prompts = prompt_list(req.prompt, "prompt")
    if "max_tokens" not in req.model_fields_set:
        # The client asked for no number: OpenAI's default (the field's), but never over this server's limit.
        req.max_tokens = min(req.max_tokens, limits.max_tokens)
    _check_limits(req, req.max_tokens, req.logprobs, limits)
    _check_prompts(prompts, req.n, limits)
    extra = vendor_extras(req, limits)
    return ParsedRequest(
        chat=False,
        model=req.model,
        sampling=_sampling(req, req.max_tokens, req.logprobs, limits),
        n=req.n,
        stream=req.stream,
        include_usage=_include_usage(req),
        continuous_usage=_continuous_usage(req),
        prompts=prompts,
        user=req.user,
        extra=extra,
        needs=_needs("completions", req, req.logprobs is not None, extra),
    )


def parse_chat(body: Any, limits: RequestLimits) -> ParsedRequest:
    raw = body.get("messages") if isinstance(body, dict) else None
    if isinstance(raw, list):  # before validating each of them
        check_message_count(raw, limits)
    req = validate_body(ChatBody, body)
    calls = sum(len(m.tool_calls or ()) for m in req.messages)
    if calls > limits.max_tool_calls:
        raise InvalidRequestError(f"The messages hold {calls} tool calls, over this server's limit of "
                                  f"{limits.max_tool_calls}.", param="messages")
    max_tokens = req.max_completion_tokens or req.max_tokens
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    _check_limits(req, max_tokens, logprobs, limits)
    check_tools(req.tools, req.tool_choice, limits)
    check_response_format(req.response_format, limits)
    extra = vendor_extras(req, limits)
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    return ParsedRequest(
        chat=True,
        model=req.model,
        sampling=_sampling(req, max_tokens, logprobs, limits),
        n=req.n,
        stream=req.stream,
        include_usage=_include_usage(req),
        continuous_usage=_continuous_usage(req),
        messages=[message_dict(m) for m in req.messages],
        user=req.user,
        tools=tools,
        # Without tools, "none" and "auto" ask for nothing: not sent (check_tools refused the rest).
        tool_choice=_dumped(req.tool_choice) if tools else None,
        parallel_tool_calls=req.parallel_tool_calls if tools else None,
        response_format=_dumped(req.response_format),
        reasoning_effort=req.reasoning_effort,
        extra=extra,
        needs=_chat_needs(req, logprobs is not None, extra),
    )


def with_cache_salt(parsed: ParsedRequest, tenant: str | None) -> ParsedRequest:
    """`parsed` carrying its tenant's cache salt (its key's or SLA class's, gateway.keys.store):
    alone, or before the client's own, which then partitions the tenant's cache further but can
    never reach another tenant's. Its deployments must accept cache_salt (it joins the needs):
    one that does not would share the prefix cache, so it refuses instead."""
    if tenant is None:
        return parsed
    extra = dict(parsed.extra or {})
    client = extra.get(CACHE_SALT)
    extra[CACHE_SALT] = tenant if client is None else f"{tenant}/{client}"
    needs = replace(parsed.needs, extras=parsed.needs.extras | {CACHE_SALT})
    passthrough = {**parsed.passthrough, CACHE_SALT: extra[CACHE_SALT]} if parsed.passthrough is not None else None
    return replace(parsed, extra=extra, needs=needs, passthrough=passthrough)


def _dumped(value):
    return value.model_dump(by_alias=True, exclude_none=True) if isinstance(value, BaseModel) else value


def _chat_needs(req: ChatBody, logprobs: bool, extra: dict) -> Needs:
    features, params = set(), []
    if req.tools:
        features.add("tools")
    elif any(m.uses_tools for m in req.messages):
        features.add("tools")
        params.append(("tools", "messages"))  # tool messages in the conversation, no tools offered
    if req.response_format is not None and req.response_format.type != "text":
        features.add(req.response_format.type)
    if req.reasoning_effort is not None:
        features.add("reasoning")
    return _needs("chat", req, logprobs, extra, features, tuple(params))


def _needs(endpoint: str, req: _Common, logprobs: bool, extra: dict | None, features=(), params=()) -> Needs:
    features = set(features)
    if logprobs:
        features.add("logprobs")
    if req.n > 1:
        features.add("n")
    return Needs(endpoint, frozenset(features), frozenset(extra or ()), params)


def vendor_extras(req: BaseModel, limits: RequestLimits) -> dict[str, Any] | None:
    """The body's vendor fields (those no model field names), within the limits, without the
    engine-only ones; None if none."""
    extra = req.model_extra
    if extra and not ENGINE_ONLY_FIELDS.isdisjoint(extra):
        extra = {k: v for k, v in extra.items() if k not in ENGINE_ONLY_FIELDS}
    if not extra:
        return None
    if len(extra) > limits.max_extra_fields:
        raise InvalidRequestError(f"{len(extra)} unrecognized (vendor) fields, over this server's limit of "
                                  f"{limits.max_extra_fields}.", param=next(iter(extra)), code="unknown_parameter")
    for name, value in extra.items():
        if not EXTRA_NAME.match(name):
            raise InvalidRequestError(f"Unrecognized request argument supplied: {name[:64]}", param=name[:64],
                                      code="unknown_parameter")
        expected = TYPED_EXTRAS.get(name)
        if name == CACHE_SALT and value is None:  # null: no salt, as vLLM reads it
            continue
        if expected is not None and (not isinstance(value, expected[0]) or value == ""):
            shown = fastjson.dumps(value)[:64].decode(errors="replace")  # JSON as sent, not a bytes repr
            raise InvalidRequestError(f"'{name}' must be {expected[1]}, got {shown}.", param=name)
        if name == CACHE_SALT and value.startswith(RESERVED_SALT_PREFIX):
            raise InvalidRequestError(f"A cache_salt starting with '{RESERVED_SALT_PREFIX}' is the gateway's own "
                                      "(a tenant's salt).", param=name)
        size = len(fastjson.dumps(value))
        if size > limits.max_extra_bytes:
            raise InvalidRequestError(f"'{name}' is {size} bytes of JSON, over this server's limit of "
                                      f"{limits.max_extra_bytes} for a vendor field.", param=name)
    return dict(extra)


def _include_usage(req: _Common) -> bool:
    return bool(req.stream_options and req.stream_options.include_usage)


def _continuous_usage(req: _Common) -> bool:
    return _include_usage(req) and req.stream_options.continuous_usage_stats


def validate_body(model: type[BaseModel], body: Any):
    if not isinstance(body, dict):
        raise InvalidRequestError("The request body must be a JSON object.")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise to_api_error(exc) from None


def to_api_error(exc: ValidationError, at: tuple = ()) -> InvalidRequestError:
    """The first error as a 400 naming its path; `at` is where the validated value sits in the body."""
    err = exc.errors()[0]
    param = format_path([*at, *_field_path(err["loc"])]) or None
    cause = (err.get("ctx") or {}).get("error")
    if isinstance(cause, Unsupported):
        return InvalidRequestError(str(cause), param=cause.param, code="unsupported_parameter")
    if err["type"] == "extra_forbidden":
        return InvalidRequestError(
            f"Unrecognized request argument supplied: {param}", param=param, code="unknown_parameter"
        )
    if err["type"] == "missing":
        return InvalidRequestError(f"Missing required parameter: '{param}'.", param=param, code="missing_required_parameter")
    message = err["msg"].removeprefix("Value error, ")
    where = f"'{param}': " if param else ""
    return InvalidRequestError(f"Invalid value for {where}{message}.", param=param)


UNION_TAG = re.compile(r"^(str|int|float|bool|none|list\[.*\]|dict\[.*\]|literal\[.*\]|[A-Z]\w*)$")


def _field_path(loc) -> list:
    """The path up to the field: pydantic appends union member tags ('str', 'list[str]') after it."""
    out = []
    for part in loc:
        if isinstance(part, str) and part.startswith("type:"):
            continue  # a tagged union's member (tool_schemas.ResponseFormat): the path goes on inside it
        if isinstance(part, str) and UNION_TAG.match(part):
            break
        out.append(part)
    return out


def prompt_list(value, param: str) -> list[str | list[int]]:
    """OpenAI's prompt (or embeddings input) as a list of prompts: a text, a list of token ids
    (one prompt), or a list of either; never empty."""
    if isinstance(value, str):
        return [value]
    if not value:
        raise InvalidRequestError(f"The {param} must not be empty.", param=param)
    if all(isinstance(p, int) for p in value):
        return [list(value)]
    return list(value)


def check_message_count(messages: list, limits: RequestLimits) -> None:
    if len(messages) > limits.max_messages:
        raise InvalidRequestError(f"Too many messages: {len(messages)} > {limits.max_messages}.", param="messages")


def _check_limits(req: _Common, max_tokens, logprobs, limits: RequestLimits) -> None:
    if max_tokens is not None and max_tokens > limits.max_tokens:
        raise InvalidRequestError(
            f"max_tokens is {max_tokens}, over this server's limit of {limits.max_tokens}.",
            param="max_tokens",
        )
    if req.n > limits.max_n:
        raise InvalidRequestError(f"n is {req.n}, over this server's limit of {limits.max_n}.", param="n")
    if len(req.stop_list()) > limits.max_stop:
        raise InvalidRequestError(f"At most {limits.max_stop} stop sequences are allowed.", param="stop")
    if logprobs is not None and logprobs > limits.max_top_logprobs:
        raise InvalidRequestError(
            f"At most {limits.max_top_logprobs} top logprobs are allowed.", param="logprobs"
        )
    longest = max(map(len, req.stop_list()), default=0)
    if longest > limits.max_stop_chars:
        raise InvalidRequestError(
            f"A stop sequence is {longest} characters, over this server's limit of {limits.max_stop_chars}.",
            param="stop")
    if req.stop_token_ids and len(req.stop_token_ids) > limits.max_stop_token_ids:
        raise InvalidRequestError(
            f"At most {limits.max_stop_token_ids} stop_token_ids are allowed.", param="stop_token_ids")


def _check_prompts(prompts: list, n: int, limits: RequestLimits) -> None:
    """The request's total work: prompts, choices (prompts x n) and token ids across prompts."""
    if len(prompts) > limits.max_prompts:
        raise InvalidRequestError(
            f"{len(prompts)} prompts, over this server's limit of {limits.max_prompts} per request.", param="prompt")
    if len(prompts) * n > limits.max_choices:
        raise InvalidRequestError(
            f"{len(prompts)} prompts x n={n} is {len(prompts) * n} choices, over this server's limit of "
            f"{limits.max_choices} per request.", param="n")
    token_ids = sum(len(p) for p in prompts if isinstance(p, list))
    if token_ids > limits.max_prompt_tokens:
        raise InvalidRequestError(
            f"The prompts hold {token_ids} token ids, over this server's limit of {limits.max_prompt_tokens}.",
            param="prompt")


def _sampling(req: _Common, max_tokens: int | None, logprobs: int | None, limits: RequestLimits) -> SamplingParams:
    # No number from the client (chat without one, or `"max_tokens": null`): never unbounded.
    # The server's limit is the bound, which the backend lowers to what the context leaves.
    return SamplingParams(
        max_tokens=limits.max_tokens if max_tokens is None else max_tokens,
        max_tokens_default=max_tokens is None,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=max(0, req.top_k or 0),
        min_p=req.min_p or 0.0,
        seed=req.seed,
        stop=tuple(s for s in req.stop_list() if s),
        stop_token_ids=tuple(req.stop_token_ids or ()),
        ignore_eos=req.ignore_eos,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=req.repetition_penalty or 1.0,
        logprobs=logprobs,
    )


def message_dict(m: Message) -> dict:
    """The message as backends see it: text content joined, `developer` as `system`, every other
    field the client set kept (an assistant message that only calls tools keeps content None)."""
    role = "system" if m.role == "developer" else m.role
    content = m.content
    if isinstance(content, list):
        content = "".join(part.text for part in content)
    if content is None and not m.tool_calls:
        content = ""
    out = {"role": role, "content": content}
    if m.name is not None:
        out["name"] = m.name
    if m.tool_calls:
        out["tool_calls"] = [call.model_dump() for call in m.tool_calls]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.refusal is not None:
        out["refusal"] = m.refusal
    return out
