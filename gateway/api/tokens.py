"""POST /v1/embeddings, /tokenize and /detokenize: one backend call per request, no generation.

Each request is validated and bounded (protocol/tokens.py), resolved to a model the caller's key
may use, refused with a 400 when no deployment of the model serves the endpoint, counted against
the key's requests/min (and its tokens/min by the tokens it used), admitted to the pool like a
completion (queue, SLA class), and sent to one deployment that declared the endpoint. A
deployment that fails (an error, no answer within the model's `timeouts.first_token_s`) is
charged to its breaker and the call goes to the next one, then to the fallback models; an error
the request caused is answered as it is. Metrics, the trace and the observer hooks record it
like a completion (operation "embeddings", "tokenize", "detokenize").
"""

from __future__ import annotations

import asyncio
import base64
import struct
import time
import uuid
from dataclasses import replace

from starlette.requests import Request
from starlette.responses import JSONResponse

from gateway.api import generate as api
from gateway.backend import DetokenizeRequest, EmbeddingRequest, EmbeddingResult, TokenizeRequest, TokenizeResult
from gateway.dispatch.choices import with_failover
from gateway.dispatch.recorder import RequestRecorder
from gateway.errors import APIError, BackendError, BackendTimeout, InvalidRequestError
from gateway.http.asgi import run_until_disconnect
from gateway.plugins import notify
from gateway.pools.admission import Ticket
from gateway.protocol.tokens import parse_detokenize, parse_embeddings, parse_tokenize
from gateway.state import state_of
from gateway.translate.anthropic import parse_count_tokens


async def embeddings(request: Request):
    parsed = await api.parsed_body(request, parse_embeddings)

    def build(request_id, priority, trace):
        return EmbeddingRequest(request_id=request_id, model=parsed.model, inputs=parsed.inputs,
                                dimensions=parsed.dimensions, user=parsed.user, priority=priority,
                                trace_context=trace, extra=parsed.extra or {}, needs=parsed.needs)

    # Each input is a sequence the engine runs (up to max_embedding_inputs of them): counted as a
    # request's worth of work each, and its tokens reserved up front (a text's characters bound
    # them; the usage is charged and the rest refunded when it finishes), as generation does.
    reserve = sum(len(item) for item in parsed.inputs)
    call = await _serve(request, parsed.model, parsed.needs, "embeddings", "embd", build, _embed,
                        weight=len(parsed.inputs), reserve_tokens=reserve)
    if call.answer is None:
        return call.closed()
    result: EmbeddingResult = call.answer
    usage = {"prompt_tokens": result.prompt_tokens, "total_tokens": result.prompt_tokens}
    data = [{"object": "embedding", "index": i, "embedding": _encoded(vector, parsed.encoding_format)}
            for i, vector in enumerate(result.embeddings)]
    call.recorder.finish(200, usage)
    return api.FastJSONResponse({"id": call.request_id, "object": "list", "created": int(time.time()),
                                 "model": call.pool.name, "data": data, "usage": usage})


async def tokenize(request: Request):
    call = await _token_call(request, parse_tokenize, TokenizeRequest, "tokenize", _tokenize)
    if call.answer is None:
        return call.closed()
    result: TokenizeResult = call.answer
    call.recorder.finish(200, {"prompt_tokens": len(result.tokens), "total_tokens": len(result.tokens)})
    max_model_len = result.max_model_len or _known_context(call.deployment)
    return api.FastJSONResponse({"count": len(result.tokens), "max_model_len": max_model_len,
                                 "tokens": result.tokens, "token_strs": result.token_strs})


async def detokenize(request: Request):
    call = await _token_call(request, parse_detokenize, DetokenizeRequest, "detokenize", _detokenize)
    if call.answer is None:
        return call.closed()
    tokens = len(call.backend_request.tokens)
    call.recorder.finish(200, {"prompt_tokens": tokens, "total_tokens": tokens})
    return api.FastJSONResponse({"prompt": call.answer})


async def count_message_tokens(request: Request):
    """Anthropic's POST /v1/messages/count_tokens: the conversation tokenized by a deployment
    that serves tokenize, with the model's own chat template; answered {"input_tokens": n}."""
    parsed = await api.parsed_body(request, parse_count_tokens)

    def build(request_id, priority, trace):
        return TokenizeRequest(request_id=request_id, model=parsed.model, priority=priority, trace_context=trace,
                               needs=parsed.needs, **parsed.fields)

    call = await _serve(request, parsed.model, parsed.needs, "tokenize", "msg", build, _tokenize)
    if call.answer is None:
        return call.closed()
    count = len(call.answer.tokens)
    call.recorder.finish(200, {"prompt_tokens": count, "total_tokens": count})
    return api.FastJSONResponse({"input_tokens": count})


async def _token_call(request: Request, parse, request_type, operation: str, method) -> "_Call":
    """Parse a /tokenize or /detokenize body and make its call (the model may be left out)."""
    parsed = await api.parsed_body(request, parse)
    with api.refusals_counted(request, parsed.model):
        model = _model_or_only_one(request, parsed.model)

    def build(request_id, priority, trace):
        return request_type(request_id=request_id, model=model, priority=priority, trace_context=trace,
                            needs=parsed.needs, **parsed.fields)

    return await _serve(request, model, parsed.needs, operation, operation[:5], build, method)


async def _embed(backend, request):
    return await backend.embed(request)


async def _tokenize(backend, request):
    return await backend.tokenize(request)


async def _detokenize(backend, request):
    return await backend.detokenize(request)


class _Call:
    """The outcome of `_serve`: the backend's answer (None: the client left) and its books."""

    def __init__(self, answer, recorder: RequestRecorder, pool, backend_request, deployment=None):
        self.answer, self.recorder, self.pool, self.backend_request = answer, recorder, pool, backend_request
        self.request_id = backend_request.request_id
        self.deployment = deployment

    def closed(self) -> JSONResponse:
        self.recorder.finish(api.CLIENT_CLOSED, None)
        return JSONResponse({}, status_code=api.CLIENT_CLOSED)


async def _serve(request: Request, model: str, needs, operation: str, id_prefix: str, build, call,
                 weight: int = 1, reserve_tokens: int = 0) -> _Call:
    state = state_of(request)
    key = api._api_key(request)
    with api.refusals_counted(request, model):
        pool, adapter = api._resolve_pool(state, key, model)  # an adapter tokenizes as its base model
        if adapter is not None and needs.endpoint == "embeddings":
            raise InvalidRequestError(f"Model '{model}' is a LoRA adapter: adapters do not serve /v1/embeddings yet.",
                                      param="model")
        pool.check_servable(needs)
        sla = api._sla_class(request, state, key)
    if key is not None:
        await api._admit_key(state, key, weight, reserve_tokens)
    request_id = f"{id_prefix}-{uuid.uuid4().hex}"
    recorder = RequestRecorder(state, key=key, request_id=request_id, model=pool.name, sla_class=sla.name,
                               operation=operation, headers=request.headers, path=request.scope["path"],
                               sampling=None)
    notify(state.pm, "request_started", request_id=request_id, model=pool.name, sla_class=sla.name)
    trace = {k: v for k, v in request.headers.items() if k in api.TRACE_HEADERS}
    backend_request = build(request_id, sla.priority, trace)
    ticket = Ticket(sla.priority, sla.sheddable, sla.max_queue_wait_s, sla.name)
    try:
        finished, outcome = await run_until_disconnect(
            request.receive, call_with_failover(state.registry, pool, backend_request, ticket, recorder, call))
    except BaseException as exc:
        api._finish_failed(recorder, exc)
        raise
    if not finished:
        return _Call(None, recorder, pool, backend_request)
    answer, deployment = outcome
    return _Call(answer, recorder, pool, backend_request, deployment)


async def call_with_failover(registry, pool, request, ticket: Ticket, recorder, call):
    """(call(backend, request)'s answer, the deployment that gave it), failing over as a
    generation's choice does (choices.with_failover)."""

    async def attempt(current, deployment, sent, span, attempts: int):
        answer = await _attempt(current, deployment, replace(sent, model=deployment.upstream_model), call)
        current.release(deployment)
        if span is not None:
            span.end()
        return answer, deployment

    return await with_failover(registry, pool, request, ticket, recorder, attempt)


async def _attempt(pool, deployment, request, call):
    """One call on one deployment, its breaker told how it went (a request's own error, or a
    load refusal, is no verdict on the backend)."""
    timeout = pool.config.timeouts.first_token_s
    breaker = deployment.breaker
    try:
        async with asyncio.timeout(timeout):
            answer = await call(deployment.backend, request)
    except BaseException as exc:
        breaker.judge(exc)
        if isinstance(exc, TimeoutError):
            raise BackendTimeout(f"The backend '{deployment.name}' did not answer within {timeout:g} s.") from None
        if isinstance(exc, Exception) and not isinstance(exc, APIError):  # a backend bug: no traceback leaks
            raise BackendError(f"The backend '{deployment.name}' failed: {type(exc).__name__}.") from exc
        raise
    breaker.record_success()
    return answer


def _model_or_only_one(request: Request, model: str | None) -> str:
    """vLLM's /tokenize needs no model (it serves one): neither does a gateway that serves one."""
    if model is not None:
        return model
    pools = state_of(request).registry.pools
    if len(pools) == 1:
        return pools[0].name
    raise InvalidRequestError("Missing required parameter: 'model' (this server serves several models).",
                              param="model", code="missing_required_parameter")


def _known_context(deployment) -> int | None:
    """The context length a backend reports in its load snapshot's info, if it does."""
    value = deployment.backend.load().info.get("max_model_len") if deployment is not None else None
    return int(value) if value else None


def _encoded(vector: list[float], encoding_format: str):
    """float: the numbers; base64: little-endian float32 bytes, as OpenAI sends (and its client
    asks for by default)."""
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
    return vector
