"""OpenAI request bodies: validated, then turned into what backends need.

Parameters fall in three groups, and none is silently misread:
- supported: mapped onto `SamplingParams`;
- accepted and ignored, because they do not change the output: `user` (passed to the backend
  for its logs), `metadata`, `store`, `service_tier`, `parallel_tool_calls`;
- known but unsupported (`tools`, `functions`, `logit_bias`, `suffix`, `echo`, `best_of` > n,
  `response_format` other than text, audio): rejected with a 400 naming the parameter;
- anything else: rejected as an unrecognized argument, the way OpenAI does.
vLLM-style extensions are supported: `top_k`, `min_p`, `repetition_penalty`, `ignore_eos`,
`stop_token_ids`.

Every number is bounded to what every backend can represent (seeds are unsigned 63-bit, token
ids and top_k signed 32-bit, floats finite), and a request's total work by `server.limits`
(prompts, choices, token ids, stop criteria), so no value can reach an engine that would fail
there for everyone.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator

from gateway.backend import SamplingParams
from gateway.config import RequestLimits, format_path
from gateway.errors import InvalidRequestError

IGNORED = ("metadata", "store", "service_tier", "parallel_tool_calls")

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


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class _Common(_Strict):
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
    parallel_tool_calls: bool | None = None
    # known, unsupported unless empty
    logit_bias: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None

    @model_validator(mode="after")
    def _unsupported(self):
        for name in ("logit_bias", "tools", "functions"):
            if getattr(self, name):
                raise _Unsupported(name)
        for name in ("tool_choice", "function_call"):
            if getattr(self, name) not in (None, "none"):
                raise _Unsupported(name)
        return self

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionBody(_Common):
    prompt: Union[str, list[str], list[TokenId], list[list[TokenId]]]
    max_tokens: Int | None = Field(DEFAULT_COMPLETION_TOKENS, ge=1)
    logprobs: Int | None = Field(None, ge=0)
    echo: bool = False
    best_of: Int | None = Field(None, ge=1)
    suffix: str | None = None

    @model_validator(mode="after")
    def _completion_unsupported(self):
        if self.echo:
            raise _Unsupported("echo")
        if self.suffix:
            raise _Unsupported("suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise _Unsupported("best_of", "best_of other than n is not supported")
        return self


class ContentPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    @model_validator(mode="after")
    def _content_required(self):
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        return self


class ResponseFormat(_Strict):
    type: Literal["text"]


class ChatBody(_Common):
    messages: list[Message] = Field(min_length=1)
    max_tokens: Int | None = Field(None, ge=1)
    max_completion_tokens: Int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: Int | None = Field(None, ge=0)
    response_format: ResponseFormat | None = None
    modalities: list[Literal["text"]] | None = None
    audio: Any = None

    @model_validator(mode="after")
    def _chat_rules(self):
        if self.audio is not None:
            raise _Unsupported("audio")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self


class _Unsupported(ValueError):
    def __init__(self, param: str, message: str | None = None):
        super().__init__(message or f"'{param}' is not supported by this server")
        self.param = param


@dataclass
class ParsedRequest:
    """A validated request: what to run, how many choices, and how to answer."""

    chat: bool
    model: str
    sampling: SamplingParams
    n: int
    stream: bool
    include_usage: bool
    prompts: list[str | list[int]] | None = None  # completions: one entry per prompt
    messages: list[dict] | None = None  # chat
    user: str | None = None

    @property
    def num_choices(self) -> int:
        return self.n * (len(self.prompts) if self.prompts is not None else 1)


def parse_completion(body: Any, limits: RequestLimits) -> ParsedRequest:
    req = _validate(CompletionBody, body)
    prompts = _prompt_list(req.prompt)
    if "max_tokens" not in req.model_fields_set:
        # The client asked for no number: OpenAI's default, but never over this server's limit.
        req.max_tokens = min(DEFAULT_COMPLETION_TOKENS, limits.max_tokens)
    _check_limits(req, req.max_tokens, req.logprobs, limits)
    _check_prompts(prompts, req.n, limits)
    return ParsedRequest(
        chat=False,
        model=req.model,
        sampling=_sampling(req, req.max_tokens, req.logprobs),
        n=req.n,
        stream=req.stream,
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        prompts=prompts,
        user=req.user,
    )


def parse_chat(body: Any, limits: RequestLimits) -> ParsedRequest:
    req = _validate(ChatBody, body)
    if len(req.messages) > limits.max_messages:
        raise InvalidRequestError(
            f"Too many messages: {len(req.messages)} > {limits.max_messages}.", param="messages"
        )
    max_tokens = req.max_completion_tokens or req.max_tokens
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    _check_limits(req, max_tokens, logprobs, limits)
    return ParsedRequest(
        chat=True,
        model=req.model,
        sampling=_sampling(req, max_tokens, logprobs),
        n=req.n,
        stream=req.stream,
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        messages=[_message_dict(m) for m in req.messages],
        user=req.user,
    )


def _validate(model: type[BaseModel], body: Any):
    if not isinstance(body, dict):
        raise InvalidRequestError("The request body must be a JSON object.")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise _to_api_error(exc) from None


def _to_api_error(exc: ValidationError) -> InvalidRequestError:
    err = exc.errors()[0]
    param = format_path(_field_path(err["loc"])) or None
    cause = (err.get("ctx") or {}).get("error")
    if isinstance(cause, _Unsupported):
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


UNION_TAG = re.compile(r"^(str|int|float|bool|none|list\[.*\]|dict\[.*\]|[A-Z]\w*)$")


def _field_path(loc) -> list:
    """The path up to the field: pydantic appends union member tags ('str', 'list[str]') after it."""
    out = []
    for part in loc:
        if isinstance(part, str) and UNION_TAG.match(part):
            break
        out.append(part)
    return out


def _prompt_list(prompt) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise InvalidRequestError("The prompt must not be empty.", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    return list(prompt)


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


def _sampling(req: _Common, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens,
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


def _message_dict(m: Message) -> dict:
    role = "system" if m.role == "developer" else m.role
    content = m.content
    if isinstance(content, list):
        content = "".join(part.text for part in content)
    return {"role": role, "content": content or ""}
