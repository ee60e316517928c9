"""The OpenAI endpoints: /v1/models, /v1/completions, /v1/chat/completions."""

from __future__ import annotations

import json
import logging
import uuid

from starlette.requests import Request
from starlette.responses import JSONResponse

from gateway.asgi import EventStreamResponse, run_until_disconnect
from gateway.choices import OpenChoice, choice_requests, merged_events, open_choices
from gateway.errors import APIError, InvalidRequestError
from gateway.plugins import notify
from gateway.responses import (
    SSE_DONE,
    ChoiceState,
    ResponseShape,
    full_body,
    sse,
    stream_chunk,
    total_usage,
    usage_chunk,
)
from gateway.schemas import ParsedRequest, parse_chat, parse_completion

log = logging.getLogger("kvgate.api")


async def list_models(request: Request) -> JSONResponse:
    state = request.app.state.kvgate
    created = int(state.started_at)
    data = [
        {"id": pool.name, "object": "model", "created": created, "owned_by": "kvgate"}
        for pool in state.registry.pools
    ]
    return JSONResponse({"object": "list", "data": data})


async def completions(request: Request):
    return await _serve(request, parse_completion, "cmpl")


async def chat_completions(request: Request):
    return await _serve(request, parse_chat, "chatcmpl")


async def _serve(request: Request, parse, id_prefix: str):
    state = request.app.state.kvgate
    parsed: ParsedRequest = parse(await _json_body(request), state.config.server.limits)
    pool = state.registry.resolve(parsed.model)
    request_id = f"{id_prefix}-{uuid.uuid4().hex}"
    notify(state.pm, "request_started", request_id=request_id, model=pool.name, sla_class=None)
    shape = ResponseShape(
        chat=parsed.chat, id=request_id, model=pool.name, want_logprobs=parsed.sampling.logprobs is not None
    )
    try:
        choices = await open_choices(pool, choice_requests(parsed, request_id))
    except APIError as exc:
        notify(state.pm, "request_finished", request_id=request_id, model=pool.name, status=exc.status, usage=None)
        raise
    if parsed.stream:
        return EventStreamResponse(_stream(state, parsed, shape, choices))
    finished, body = await run_until_disconnect(request.receive, _collect(parsed, shape, choices))
    status = 200 if finished else 499  # 499: client closed the request (nginx's convention)
    notify(state.pm, "request_finished", request_id=request_id, model=pool.name, status=status,
           usage=body["usage"] if body else None)
    return JSONResponse(body) if finished else JSONResponse({}, status_code=499)


async def _json_body(request: Request):
    raw = await request.body()
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidRequestError(f"The request body is not valid JSON: {exc}.") from None


async def _collect(parsed: ParsedRequest, shape: ResponseShape, choices: list[OpenChoice]) -> dict:
    states = [ChoiceState(c.index) for c in choices]
    try:
        async for index, event in merged_events(choices):
            states[index].add(event)
    finally:
        for c in choices:
            await c.close()
    return full_body(shape, states, total_usage(states, _prompt_tokens(states, parsed.n)))


async def _stream(state, parsed: ParsedRequest, shape: ResponseShape, choices: list[OpenChoice]):
    states = [ChoiceState(c.index) for c in choices]
    status = "stream_error"
    try:
        if parsed.chat:
            for c in choices:
                yield sse(stream_chunk(shape, c.index, None, first=True))
        async for index, event in merged_events(choices):
            states[index].add(event)
            if event.text or event.finish_reason or event.logprobs:
                yield sse(stream_chunk(shape, index, event, first=False))
        usage = total_usage(states, _prompt_tokens(states, parsed.n))
        if parsed.include_usage:
            yield sse(usage_chunk(shape, usage))
        status = 200
    except APIError as exc:
        # After the first byte the status is sent: the client learns of the failure from one
        # error event (the openai client raises on it), then the stream ends as usual.
        log.warning("stream %s failed after it started: %s", shape.id, exc.message)
        yield sse(exc.body())
    finally:
        for c in choices:
            await c.close()
        notify(state.pm, "request_finished", request_id=shape.id, model=shape.model, status=status, usage=None)
    yield SSE_DONE


def _prompt_tokens(states: list[ChoiceState], n: int) -> dict[int, int]:
    return {s.index // n: s.usage.prompt_tokens for s in states if s.usage}
