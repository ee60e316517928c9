"""Our request as an OpenAI request body, and OpenAI stream chunks as our token events.

Only what differs from the OpenAI defaults is sent, so an upstream that lacks an extension never
sees it unless the client asked for it. vLLM's extensions (top_k, min_p, repetition_penalty,
ignore_eos, stop_token_ids) go out only when set. Tools, tool_choice, response_format and
reasoning_effort go out as the client sent them (validated), vendor fields (`extra`) verbatim;
the gateway routed the request here because this deployment declared them.

Back from the upstream: text, logprobs, and the fields agents and JSON-mode clients need:
tool calls (whole, or streamed fragments by index), `reasoning_content` (vLLM and SGLang; newer
vLLM says `reasoning`), `refusal`, and finish reasons tool_calls and content_filter.
"""

from __future__ import annotations

from dataclasses import replace

from gateway import fastjson
from gateway.backend import (
    TRANSFER_PARAMS, GenerationRequest, SamplingParams, TokenEvent, TokenLogprob, ToolCallDelta, TopLogprob, Usage,
    token_event)
from kvgate_openai.counts import MAX_COUNT, token_count
from kvgate_openai.relay import PATHS

COMPLETIONS = "/completions"
CHAT = "/chat/completions"
STREAM_OPTIONS = {"include_usage": True}
# The client asked for vLLM's usage in every chunk: so is the upstream (vLLM, SGLang, kvgate honour
# it; an upstream that ignores it leaves the gateway to count; one that refuses it says so).
CONTINUOUS_STREAM_OPTIONS = {"include_usage": True, "continuous_usage_stats": True}


def request_body(request: GenerationRequest, chat_max_tokens_field: str = "max_tokens") -> tuple[str, dict]:
    """(path, JSON body) for one choice. A streaming client's choice streams from upstream, with
    usage at the end; a non-streaming client's is asked for in one piece (one read, not one per
    token, and upstream errors keep their status). A passed-through body goes as the client sent
    it (validated), to its API's path, with the upstream's model name (a LoRA adapter's, vLLM's way)."""
    model = request.needs.adapter or request.model
    if request.passthrough is not None:
        return PATHS[request.needs.endpoint], {**request.passthrough, "model": model}
    body: dict = {"model": model, "stream": request.stream}
    if request.stream:
        body["stream_options"] = CONTINUOUS_STREAM_OPTIONS if request.continuous_usage else STREAM_OPTIONS
    chat = request.messages is not None
    if chat:
        body["messages"] = request.messages
    else:
        body["prompt"] = request.prompt
    _sampling_fields(body, request.sampling, chat, chat_max_tokens_field)
    if request.user:
        body["user"] = request.user
    if chat:
        _chat_features(body, request)
    if request.extra:
        body.update(request.extra)  # names no typed field uses (the gateway parsed those)
    return (CHAT if chat else COMPLETIONS), body


def for_llama_cpp_python(body: dict) -> None:
    """llama-cpp-python (0.3) says some things its own way: a JSON schema as `{"type":
    "json_object", "schema": ...}` (it refuses OpenAI's json_schema), and an assistant message
    that only calls tools with content "" (it refuses null, with a 500)."""
    fmt = body.get("response_format")
    if fmt is not None and fmt.get("type") == "json_schema":
        body["response_format"] = {"type": "json_object", "schema": fmt["json_schema"].get("schema") or {}}
    messages = body.get("messages")
    if messages and any(m.get("content") is None for m in messages):  # (copies: the request's stay as sent)
        body["messages"] = [{**m, "content": ""} if m.get("content") is None else m for m in messages]


def _chat_features(body: dict, request: GenerationRequest) -> None:
    if request.tools:
        body["tools"] = request.tools
        if request.tool_choice is not None:
            body["tool_choice"] = request.tool_choice
        if request.parallel_tool_calls is not None:
            body["parallel_tool_calls"] = request.parallel_tool_calls
    if request.response_format is not None:
        body["response_format"] = request.response_format
    if request.reasoning_effort is not None:
        body["reasoning_effort"] = request.reasoning_effort


def _sampling_fields(body: dict, s: SamplingParams, chat: bool, max_tokens_field: str) -> None:
    # A default bound is not sent: the gateway does not know the upstream's context, and a bound
    # over what it leaves is a 400 there; the upstream applies its own default (vLLM's is the same rule).
    if s.max_tokens is not None and not s.max_tokens_default:
        body[max_tokens_field if chat else "max_tokens"] = s.max_tokens
    if s.temperature != 1.0:
        body["temperature"] = s.temperature
    if s.top_p != 1.0:
        body["top_p"] = s.top_p
    if s.seed is not None:
        body["seed"] = s.seed
    if s.stop:
        body["stop"] = list(s.stop)
    if s.presence_penalty:
        body["presence_penalty"] = s.presence_penalty
    if s.frequency_penalty:
        body["frequency_penalty"] = s.frequency_penalty
    if s.logprobs is not None:
        if chat:
            body["logprobs"] = True
            body["top_logprobs"] = s.logprobs
        else:
            body["logprobs"] = s.logprobs
    _vllm_extensions(body, s)


def _vllm_extensions(body: dict, s: SamplingParams) -> None:
    if s.top_k > 0:
        body["top_k"] = s.top_k
    if s.min_p > 0:
        body["min_p"] = s.min_p
    if s.repetition_penalty != 1.0:
        body["repetition_penalty"] = s.repetition_penalty
    if s.ignore_eos:
        body["ignore_eos"] = True
    if s.stop_token_ids:
        body["stop_token_ids"] = list(s.stop_token_ids)


_READ = object()  # chunk_event's usage: read it from the chunk


def chunk_event(chunk: dict, chat: bool, usage: Usage | None = _READ) -> TokenEvent | None:
    """The token event in one stream chunk, or None when it carries nothing (role opener, usage).
    `usage`: the chunk's own usage when the caller has read it already (usage_of, per chunk of an
    upstream that sends continuous usage: read once, not twice)."""
    choices = chunk.get("choices")
    if not choices:
        return None
    c = choices[0]
    text, logprobs = _text_and_logprobs(c, chat, "delta")
    ids = c.get("token_ids")  # vLLM sends them when asked (return_token_ids)
    token_ids = tuple(ids) if ids else ()
    reason = c.get("finish_reason")
    if reason is not None:  # only the last chunk has one: no call per token
        reason = finish_reason(reason)
    delta = c.get("delta") if chat else None
    if delta and len(delta) > ("content" in delta) + ("role" in delta):  # more than text: rare
        return _event_with_more(delta, text, token_ids, logprobs, reason, streamed=True)
    if not (text or logprobs or reason or token_ids):
        return None
    # The counts so far, when the upstream sends them in every chunk (continuous usage stats).
    if usage is _READ:
        usage = usage_of(chunk) if "usage" in chunk else None
    return token_event(text, token_ids, logprobs, reason, usage)  # one per token: the cheap constructor


def _event_with_more(message: dict, text: str, token_ids, logprobs, reason, streamed: bool) -> TokenEvent | None:
    """A chat delta (or whole message) that carries tool calls, reasoning or a refusal too."""
    calls = _tool_calls(message.get("tool_calls"), streamed)
    reasoning = message.get("reasoning_content") or message.get("reasoning") or ""
    refusal = message.get("refusal") or ""
    if not (text or logprobs or reason or token_ids or calls or reasoning or refusal):
        return None
    return TokenEvent(text=text, token_ids=token_ids, logprobs=logprobs, finish_reason=reason,
                      tool_calls=calls, reasoning=_text(reasoning), refusal=_text(refusal))


def _tool_calls(calls, streamed: bool) -> tuple[ToolCallDelta, ...]:
    """OpenAI tool calls (stream fragments with `index`, or a whole message's list) as ours."""
    if not isinstance(calls, list):
        return ()
    out = []
    for position, call in enumerate(calls):
        if not isinstance(call, dict):
            continue
        function = call.get("function") if isinstance(call.get("function"), dict) else {}
        index = call.get("index") if streamed and isinstance(call.get("index"), int) else position
        arguments = function.get("arguments")
        if isinstance(arguments, (dict, list)):  # a few servers send an object, not its JSON text
            arguments = fastjson.dumps(arguments).decode()
        out.append(ToolCallDelta(index=index, id=_text(call.get("id")) or None, name=_text(function.get("name")) or None,
                                 arguments=_text(arguments)))
    return tuple(out)


def _text(value) -> str:
    return value if isinstance(value, str) else ""


def whole_event(body: dict, chat: bool) -> TokenEvent:
    """The one event of a non-streamed answer: all its text, its finish reason and usage."""
    choices = body.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise ValueError("the answer has no choices")
    c = choices[0]
    text, logprobs = _text_and_logprobs(c, chat, "message")
    token_ids = tuple(c.get("token_ids") or ())
    reason = finish_reason(c.get("finish_reason")) or "stop"
    event = TokenEvent(text=text, token_ids=token_ids, logprobs=logprobs, finish_reason=reason, usage=usage_of(body),
                       kv_transfer_params=transfer_params(body))
    message = c.get("message") if chat else None
    if isinstance(message, dict) and len(message) > ("content" in message) + ("role" in message):
        more = _event_with_more(message, text, token_ids, logprobs, reason, streamed=False)
        return replace(more, usage=event.usage, kv_transfer_params=event.kv_transfer_params)  # never None
    return event


def transfer_params(body: dict) -> dict | None:
    """vLLM's top-level `kv_transfer_params` of an answer (a prefill engine's KV connector sets
    it when the request asked for remote decode and stopped on length), when it is an object."""
    params = body.get(TRANSFER_PARAMS)
    return params if isinstance(params, dict) else None


def _text_and_logprobs(choice: dict, chat: bool, chat_field: str) -> tuple[str, tuple[TokenLogprob, ...]]:
    """A choice's text and logprobs; chat text sits in `delta` (stream) or `message` (whole)."""
    lp = choice.get("logprobs")  # usually absent: no call to parse nothing
    if chat:
        return (choice.get(chat_field) or {}).get("content") or "", chat_logprobs(lp) if lp else ()
    return choice.get("text") or "", completion_logprobs(lp) if lp else ()


FINISH_REASONS = ("stop", "length", "abort", "tool_calls", "content_filter")


def finish_reason(reason: str | None) -> str | None:
    # Our protocol's reasons pass as they are (function_call is the old name of tool_calls);
    # anything else a server invents ends like a stop.
    if reason is None or reason in FINISH_REASONS:
        return reason
    return "tool_calls" if reason == "function_call" else "stop"


def usage_of(chunk: dict) -> Usage | None:
    """The chunk's usage; ValueError naming the field when a count is not a whole number in
    [0, 2**31): it is charged to keys' tokens per minute (in Redis, for every replica), where a
    negative, fractional or huge count would corrupt the window."""
    u = chunk.get("usage")
    if not u:
        return None
    if not isinstance(u, dict):
        raise ValueError("usage is not an object")
    details = u.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if details and isinstance(details, dict) else None
    prompt, completion = u.get("prompt_tokens"), u.get("completion_tokens")
    if type(prompt) is int and type(completion) is int and cached is None and (  # the usual: two plain counts
            0 <= prompt <= MAX_COUNT and 0 <= completion <= MAX_COUNT):
        return Usage(prompt, completion)  # what token_count would return, read once per chunk
    return Usage(token_count(u, "prompt_tokens"), token_count(u, "completion_tokens"),
                 0 if cached is None else token_count({"cached_tokens": cached}, "cached_tokens"))


def completion_logprobs(lp: dict | None) -> tuple[TokenLogprob, ...]:
    """`{tokens, token_logprobs, top_logprobs: [{token: logprob}]}` to our logprobs."""
    if not lp or not lp.get("tokens"):
        return ()
    tops = lp.get("top_logprobs") or [None] * len(lp["tokens"])
    return tuple(
        TokenLogprob(
            token=token,
            logprob=_number(logprob),
            top=tuple(TopLogprob(t, _number(v)) for t, v in (top or {}).items()),
        )
        for token, logprob, top in zip(lp["tokens"], lp.get("token_logprobs") or (), tops)
    )


def chat_logprobs(lp: dict | None) -> tuple[TokenLogprob, ...]:
    """`{content: [{token, logprob, top_logprobs: [{token, logprob}]}]}` to our logprobs."""
    if not lp or not lp.get("content"):
        return ()
    return tuple(
        TokenLogprob(
            token=item["token"],
            logprob=_number(item.get("logprob")),
            top=tuple(TopLogprob(t["token"], _number(t.get("logprob"))) for t in item.get("top_logprobs") or ()),
        )
        for item in lp["content"]
    )


def _number(value) -> float:
    # vLLM sends null (or -9999.0) for a logprob of -inf.
    return float("-inf") if value is None else float(value)
