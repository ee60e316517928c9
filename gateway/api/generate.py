"""The API endpoints: OpenAI's /v1/models, /v1/completions, /v1/chat/completions, and, translated
onto chat (gateway.translate), OpenAI's /v1/responses and Anthropic's /v1/messages."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import uuid
from dataclasses import replace

from starlette.requests import Request
from starlette.responses import JSONResponse

from gateway import fastjson
from gateway.budgets.ledger import WARNING_HEADER, Hold
from gateway.cache.responses import HEADER as CACHE_HEADER
from gateway.cache.responses import Lookup
from gateway.config import SlaClass
from gateway.dispatch import disagg
from gateway.dispatch.choices import OpenChoice, choice_requests, merged_events, open_choices
from gateway.dispatch.recorder import RequestRecorder
from gateway.errors import APIError, AuthenticationError, InvalidRequestError, ModelNotFound, RateLimited
from gateway.http.asgi import EventStreamResponse, run_until_disconnect, watch_disconnect
from gateway.keys.store import ApiKey, tenant_salt
from gateway.plugins import notify
from gateway.pools.admission import Ticket
from gateway.protocol.bodies import (
    SSE_DONE,
    ChoiceState,
    ResponseShape,
    full_body,
    running_usage,
    sse,
    stream_chunk,
    total_usage,
    usage_chunk,
)
from gateway.protocol.completions import EventWriter, ParsedRequest, parse_chat, parse_completion, with_cache_salt
from gateway.protocol.json_body import parse_body
from gateway.state import GatewayState, state_of
from gateway.translate.anthropic import parse_messages
from gateway.translate.responses_api import parse_responses

log = logging.getLogger("kvgate.api")

SLA_HEADER = "x-sla-class"
# The client closed the request (nginx's 499): nobody reads that response. Counted as cancelled,
# not as a failure of the service.
CLIENT_CLOSED = 499
TRACE_HEADERS = ("traceparent", "tracestate")


class FastJSONResponse(JSONResponse):
    """A whole answer, encoded by orjson (see fastjson)."""

    def render(self, content) -> bytes:
        return fastjson.dumps(content)


async def list_models(request: Request) -> JSONResponse:
    state = state_of(request)
    key = _api_key(request)
    created = int(state.started_at)
    data = [
        {"id": pool.name, "object": "model", "created": created, "owned_by": "kvgate", **_model_card(pool)}
        for pool in state.registry.pools
        if key is None or key.may_use([pool.name, *pool.aliases])
    ]
    data += _adapter_cards(state, key, created)
    return JSONResponse({"object": "list", "data": data})


def _adapter_cards(state: GatewayState, key: ApiKey | None, created: int) -> list[dict]:
    """Each LoRA adapter as vLLM lists one: its `root` the adapter's directory, its `parent` the
    base model (the pool), `max_model_len` null; only those the key may use by name."""
    taken = {n for pool in state.registry.pools for n in [pool.name, *pool.aliases]}
    cards, seen = [], set(taken)
    for pool in state.registry.pools:
        for name, root in sorted(pool.adapters().items()):
            if name in seen or (key is not None and not key.may_use([name])):
                continue  # a model's name wins over an adapter's; the first pool's adapter of a name
            seen.add(name)
            cards.append({"id": name, "object": "model", "created": created, "owned_by": "kvgate", "root": root,
                          "parent": pool.name, "max_model_len": None})
    return cards


def _model_card(pool) -> dict:
    """vLLM's fields of a /v1/models entry (`vllm bench serve` reads `root`), from what the running
    backends report in LoadSnapshot.info: `root`, the model they serve (a file, a directory, an
    upstream's model name: the deployment's upstream name when the backend says nothing), and
    `max_model_len`, the context length in tokens (the smallest of the deployments': what every
    route can take; null when none says). Plus {"weights": "int4 AWQ g64"} when they say how
    their weights are stored, {"cpu_kernels": "avx512"} when they say which CPU kernels run and
    {"prefill": "matmuls bf16, attention bf16"} how prompt chunks run (several values joined)."""
    running = [(d, d.backend.load().info) for d in pool.deployments if d.started]
    lengths = [int(info["max_model_len"]) for _, info in running if info.get("max_model_len")]
    card = {"root": _root(pool, running), "parent": None, "max_model_len": min(lengths, default=None),
            "capabilities": _capabilities(pool)}
    for key in ("weights", "cpu_kernels", "prefill"):
        values = sorted({info.get(key) for _, info in running} - {None})
        if values:
            card[key] = ", ".join(values)
    return card


def _capabilities(pool) -> dict:
    """What some deployment of the model serves (gateway.capabilities): the endpoints (whether
    it embeds, tokenizes) and request features (tools, json_schema, ...)."""
    declared = [caps for _, caps in pool.declared()]
    return {"endpoints": sorted(set().union(*(c.endpoints for c in declared))),
            "features": sorted(set().union(*(c.features for c in declared)))}


def _root(pool, running: list) -> str:
    for d, info in running:
        return info.get("root") or d.upstream_model
    return pool.deployments[0].upstream_model if pool.deployments else pool.name


async def completions(request: Request):
    return await _serve(request, parse_completion, "cmpl-")


async def chat_completions(request: Request):
    return await _serve(request, parse_chat, "chatcmpl-")


async def responses(request: Request):
    return await _serve(request, parse_responses, "resp_")


async def messages(request: Request):
    """Anthropic's Messages API (its error shape: asgi.AnthropicErrors)."""
    return await _serve(request, parse_messages, "msg_")


def _api_key(request: Request) -> ApiKey | None:
    return request.scope.get("state", {}).get("api_key")


def _resolve_pool(state: GatewayState, key: ApiKey | None, model: str):
    """(the pool `model` names, the LoRA adapter it names or None). A key's allow-list names an
    adapter itself: allowing the base model does not allow its adapters."""
    pool, adapter = state.registry.route(model)
    allowed = [model] if adapter is not None else [model, pool.name]
    if key is not None and not key.may_use(allowed):
        raise ModelNotFound(model)  # as if it did not exist: keys do not learn other models
    return pool, adapter


def _sla_class(request: Request, state: GatewayState, key: ApiKey | None) -> SlaClass:
    name = request.headers.get(SLA_HEADER) or (key.sla_class if key else None) or state.config.default_sla_class
    sla = state.config.sla_class(name)
    if sla is None:
        known = ", ".join(c.name for c in state.config.sla_classes)
        raise InvalidRequestError(f"Unknown SLA class '{name}' (known: {known}).", param=SLA_HEADER)
    if key is not None:
        key.check_sla_class(sla.name, SLA_HEADER)
    return sla


async def _serve(request: Request, parse, id_prefix: str):
    state = state_of(request)
    registry = state.registry  # the one this request was routed in, across a reload
    key = _api_key(request)
    parsed, pool, sla = await parsed_body(request, functools.partial(_parse_and_route, request, state, key, parse))
    cache = state.caches.get(pool.name)
    found = await cache.lookup(parsed, key, request.headers) if cache is not None else None
    hit = found is not None and found.hit is not None
    free = hit and not cache.cfg.count_hits  # a hit costs 0 tokens: it still counts as a request
    if key is not None:
        reserve = 0 if free else (parsed.sampling.max_tokens or 0) * parsed.num_choices
        await _admit_key(state, key, parsed.num_choices, reserve)
    hold = await _reserve_budgets(state, key, pool.name, parsed, free)
    request_id = f"{id_prefix}{uuid.uuid4().hex}"
    recorder = RequestRecorder(
        state, key=key, request_id=request_id, model=pool.name, sla_class=sla.name,
        operation="chat" if parsed.chat else "text_completion", headers=request.headers,
        path=request.scope["path"], sampling=parsed.sampling, n=parsed.n,
    )  # (the scope's path: request.url builds and parses a whole URL, ~2.5 % of a request's CPU)
    recorder.hold, recorder.free = hold, free
    if found is not None:
        _cache_noted(recorder, cache, found)
    notify(state.pm, "request_started", request_id=request_id, model=pool.name, sla_class=sla.name)
    shape = ResponseShape(
        chat=parsed.chat, id=request_id, model=parsed.needs.adapter or pool.name,
        want_logprobs=parsed.sampling.logprobs is not None,
    )
    ticket = Ticket(sla.priority, sla.sheddable, sla.max_queue_wait_s, sla.name)
    if hit:  # no backend request: the choices' events are the entry's
        opening = _replayed(cache.replay(found))
    else:
        trace = {k: v for k, v in request.headers.items() if k in TRACE_HEADERS}
        requests = choice_requests(parsed, request_id, sla.priority, trace)
        opening = open_choices(registry, pool, requests, ticket, recorder, disagg.opener(pool))
    if not parsed.stream:
        return _headed(await _answer_whole(request, recorder, parsed, shape, opening, watch=not hit), hold, found)
    # Watch the client from the start: one that leaves while queued, or before the first token,
    # frees its queue slot and aborts its backend work now, not when a token comes. The same
    # watcher then serves the stream. A hit's choices are open at once: no task to wait on them.
    watcher = watch_disconnect(request.receive)
    try:
        opened, choices = (True, await opening) if hit else await run_until_disconnect(
            request.receive, opening, orphan=lambda late: _release(recorder, late), watcher=watcher)
    except BaseException as exc:
        watcher.cancel()
        _finish_failed(recorder, exc)
        raise
    if not opened:
        watcher.cancel()
        recorder.finish(CLIENT_CLOSED, None)
        return JSONResponse({}, status_code=CLIENT_CLOSED)
    return _headed(EventStreamResponse(_stream(recorder, parsed, shape, choices), tracker=state.streams,
                                       finalizer=lambda: _release_pending(recorder, choices), watcher=watcher),
                   hold, found)


def _cache_noted(recorder: RequestRecorder, cache, found: Lookup) -> None:
    """The recorder keeps a miss's events for the cache; a hit is served by no deployment."""
    recorder.cache = (cache, found)
    if found.hit is None:
        recorder.capture = found if found.store else None
    else:
        recorder.deployment, recorder.replayed = "cache", True
    if recorder.trace is not None:
        recorder.trace.root.set_attribute("kvgate.cache", "hit" if found.hit is not None else "miss")


async def _replayed(choices: list) -> list:
    return choices


async def _reserve_budgets(state: GatewayState, key: ApiKey | None, model: str, parsed: ParsedRequest,
                           free: bool) -> Hold | None:
    """The request's hold on its key's and team's budgets (None: none apply). A refusal (429)
    also ends the key's admission: it counted as a request, it holds no slot."""
    if key is None or state.budgets is None:
        return None
    try:
        return await state.budgets.reserve(key, model, parsed, free)
    except BaseException:
        state.limiter.finish(key, 0)
        raise


def _headed(response, hold: Hold | None, found: Lookup | None):
    """The answer, with the budgets past their soft limit named in a header, and whether the
    response cache answered it."""
    if hold is not None and hold.warnings:
        response.headers[WARNING_HEADER] = ", ".join(hold.warnings)
    if found is not None:
        response.headers[CACHE_HEADER] = "hit" if found.hit is not None else "miss"
    return response


async def key_info(request: Request) -> JSONResponse:
    """The caller's own key: its name, team and budgets with their spend (LiteLLM's /key/info,
    scoped to the key that asks: no key can read another's)."""
    key = _api_key(request)
    if key is None:
        raise AuthenticationError("GET /key/info reads the budgets of the API key that calls it: send one.")
    state = state_of(request)
    budgets = await state.budgets.info(key) if state.budgets is not None else []
    return JSONResponse({"key": key.name, "team": key.team, "models": sorted(key.models) if key.models else None,
                         "budgets": budgets})


async def _answer_whole(request: Request, recorder: RequestRecorder, parsed: ParsedRequest, shape: ResponseShape,
                        opening, watch: bool = True) -> JSONResponse:
    """Open the choices and collect their answers under one watch of the client (one task and
    one watcher per request, not two of each): a client that leaves at any point aborts them.
    `watch` false (a cache hit: its answer is in memory, nothing waits) runs it in the request's
    own task, with no watcher: two tasks and a wait less per hit."""
    choices: list[OpenChoice] = []

    async def open_then_collect() -> tuple[dict, list[ChoiceState]]:
        choices.extend(await opening)
        if asyncio.current_task().cancelling():
            # The client left while the choices opened, and the opening finished anyway (a
            # swallowed cancellation): do not generate for nobody.
            raise asyncio.CancelledError
        return await _collect(recorder, parsed, shape, choices)

    try:
        if watch:
            finished, collected = await run_until_disconnect(request.receive, open_then_collect())
        else:
            finished, collected = True, await open_then_collect()
        body, states = collected if collected else (None, [])
        recorder.finish(200 if finished else CLIENT_CLOSED, body["usage"] if body else None,
                        [c["finish_reason"] for c in body["choices"]] if body else ())
    except BaseException as exc:
        _finish_failed(recorder, exc)
        raise
    finally:
        pending = _release_pending(recorder, choices)  # also when _collect never got to start
        if pending is not None:
            await asyncio.shield(pending)
    if not finished:
        return JSONResponse({}, status_code=CLIENT_CLOSED)
    if parsed.translation is not None:
        body = parsed.translation.whole(shape, body, states)
    elif disagg.trusted(recorder.key) and (params := disagg.answered_params(choices)) is not None:
        body["kv_transfer_params"] = params  # a prefill hop's answer, for the gateway that sent it
    return FastJSONResponse(body)


def _finish_failed(recorder: RequestRecorder, exc: BaseException) -> None:
    if isinstance(exc, APIError):
        recorder.finish(exc.status, None, error=exc.message)
    else:
        recorder.finish(CLIENT_CLOSED, None)


def _release_pending(recorder: RequestRecorder, choices: list[OpenChoice]):
    """`_release(...)` when something is left to release, else None (the usual end: no task)."""
    if recorder.done and all(c.closed for c in choices):
        return None
    return _release(recorder, choices)


async def _release(recorder: RequestRecorder, choices: list[OpenChoice]) -> None:
    """Close every choice and the books (both idempotent, so a no-op after a normal end): a
    response cancelled before its producer ran would otherwise keep its deployment slots and
    its key's in-flight count."""
    for c in choices:
        await c.close()
    recorder.finish(CLIENT_CLOSED, None)


def _parse_and_route(request: Request, state: GatewayState, key: ApiKey | None, parse, body, limits):
    """The request parsed and checked, its pool and its SLA class; an APIError (a 4xx) if not."""
    parsed: ParsedRequest = disagg.engine_hop(parse(body, limits), key, body)
    pool, adapter = _resolve_pool(state, key, parsed.model)
    if parsed.translation is not None:  # passed through where a deployment serves the API itself
        parsed = parsed.translation.routed(parsed, pool.declared())
    if adapter is not None:
        parsed = replace(parsed, needs=replace(parsed.needs, adapter=adapter))
    sla = _sla_class(request, state, key)
    parsed = with_cache_salt(parsed, key.salt_for(sla.cache_salt) if key is not None else tenant_salt(
        sla.cache_salt, None))
    pool.check_servable(parsed.needs)
    return parsed, pool, sla


async def parsed_body(request: Request, parse):
    """`parse(body, limits)` of the request's JSON body (a parse that also routes the request
    returns its route too: `_serve`'s), in the admission order every endpoint keeps: a key at its limit is refused before the body is read, and a body refused by the
    parse still counts as one of the key's requests."""
    limits = state_of(request).config.server.limits
    await check_key_before_parsing(request)
    with refusals_counted(request) as refusal:
        body = await _json_body(request, limits)
        refusal.model = body.get("model") if isinstance(body, dict) else None
        return parse(body, limits)


async def check_key_before_parsing(request: Request) -> None:
    """A key at its limit is refused (429) before its body is read or parsed: it costs nothing."""
    key = _api_key(request)
    if key is not None:
        await _check_key(state_of(request), key)


class Refusal:
    """What is known of a request refused before it has a recorder: the model it named, if any."""

    def __init__(self, model=None):
        self.model = model


@contextlib.contextmanager
def refusals_counted(request: Request, model: str | None = None):
    """A request refused before admission (an APIError: 400, 403, 404, 413) still counts as one
    of its key's requests per minute, and in kvgate_requests_total under no deployment (and no
    SLA class: it may be the bad part); its model is the pool the body named (`model`, or the
    yielded Refusal's, set once the body is read), or "" for a model no pool has: a client's
    made-up names must not become label values."""
    refusal = Refusal(model)
    try:
        yield refusal
    except APIError as exc:
        state = state_of(request)
        key = _api_key(request)
        if key is not None:
            state.limiter.count_refused(key)
        pool = state.registry.get(refusal.model) if isinstance(refusal.model, str) else None
        state.metrics.requests.labels(pool.name if pool is not None else "", "", "", str(exc.status)).inc()
        raise


async def _check_key(state: GatewayState, key: ApiKey) -> None:
    await _rate_limited_counted(state, key, state.limiter.admissible(key))


async def _admit_key(state: GatewayState, key: ApiKey, choices: int, reserve_tokens: int) -> None:
    # Each prompt x n is a request's worth of work; the most it can generate is charged to the
    # key's tokens up front, and what it did not use is refunded when it finishes.
    await _rate_limited_counted(state, key, state.limiter.acquire(key, choices, reserve_tokens))


async def _rate_limited_counted(state: GatewayState, key: ApiKey, verdict) -> None:
    """Await the limiter's `verdict` on `key`; a refusal (429) is counted in the key's
    rate-limited metric before it goes on to the client."""
    try:
        await verdict
    except RateLimited:
        state.metrics.rate_limited.labels(key.name).inc()
        raise


async def _json_body(request: Request, limits):
    return parse_body(await request.body(), limits.max_json_depth)


async def _collect(recorder: RequestRecorder, parsed: ParsedRequest, shape: ResponseShape,
                   choices: list[OpenChoice]) -> tuple[dict, list[ChoiceState]]:
    """The whole chat answer, and the choices' states it was built from."""
    states = [ChoiceState(c.index) for c in choices]
    try:
        async for index, batch in merged_events(choices):
            recorder.tokens(index, batch)
            state = states[index]
            for event in batch:
                state.add(event)
    finally:
        for c in choices:
            await c.close()
    return full_body(shape, states, total_usage(states, _prompt_tokens(states, parsed.n))), states


class OpenAIEvents(EventWriter):
    """A stream's chunks as OpenAI sends them. A translated request brings its own writer of
    another API's events (`ParsedRequest.translation.stream`)."""

    done = SSE_DONE
    chunk = staticmethod(sse)  # sse itself: no extra call per token

    @staticmethod
    def error(exc: APIError) -> bytes:
        return sse(exc.body())


OPENAI_EVENTS = OpenAIEvents()


async def _stream(recorder: RequestRecorder, parsed: ParsedRequest, shape: ResponseShape,
                  choices: list[OpenChoice]):
    states = [ChoiceState(c.index) for c in choices]
    out = OPENAI_EVENTS if parsed.translation is None else parsed.translation.stream(shape)
    write = out.chunk
    # Left without success or an APIError: the client went away (the response task cancelled
    # this generator, or closed it at a failed write).
    status, usage, error = CLIENT_CLOSED, None, None
    try:
        continuous = parsed.continuous_usage
        if parsed.chat and parsed.passthrough is None:
            for c in choices:
                yield write(_opener(shape, c, continuous))
        async for index, batch in merged_events(choices):
            recorder.tokens(index, batch)
            state, chunks = states[index], []
            for event in batch:
                if state.add(event):  # shows the client something (not token ids or usage alone)
                    if event.raw:  # a passed-through answer goes as it came
                        chunks.append(event.raw)
                        continue
                    chunk = stream_chunk(shape, index, event, first=False)
                    if continuous:
                        chunk["usage"] = running_usage(state)
                    chunks.append(write(chunk))
            if chunks:  # the events that arrived together leave together
                data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
                if data:  # (a translation may hold a chunk back)
                    yield data
        usage = total_usage(states, _prompt_tokens(states, parsed.n))
        if parsed.include_usage:
            yield write(usage_chunk(shape, usage))
        status = 200
    except APIError as exc:
        # After the first byte the status is sent: the client learns of the failure from one
        # error event (the openai client raises on it), then the stream ends as usual.
        log.warning("stream %s failed after it started: %s", shape.id, exc.message)
        error = exc.message
        yield out.error(exc)
    finally:
        for c in choices:
            await c.close()
        recorder.finish(status, usage, [st.finish_reason for st in states], error=error)
    if out.done:
        yield out.done


def _opener(shape: ResponseShape, choice: OpenChoice, continuous: bool) -> dict:
    """The chat role opener of one choice; with continuous usage, its prompt tokens (known by
    now: every choice was opened up to its first event)."""
    chunk = stream_chunk(shape, choice.index, None, first=True)
    if continuous:
        usage = next((e.usage for e in choice.first if e.usage), None)
        chunk["usage"] = running_usage(ChoiceState(choice.index, usage=usage), opened=False)
    return chunk


def _prompt_tokens(states: list[ChoiceState], n: int) -> dict[int, int]:
    return {s.index // n: s.usage.prompt_tokens for s in states if s.usage}
