"""Running the choices of one request on backends, with failover before the first token.

Every choice is opened (deployment admitted, first event awaited) before the response starts,
so a refusal is still an ordinary HTTP error. A deployment that fails before its first token
(error, refused connection, first-token timeout) is charged to its breaker and the choice is
retried on another deployment of the pool, then on the model's fallback chain; nothing has been
sent yet, so nothing is duplicated. After the first token a failure can only end the stream.
An error the request caused (`backend_fault` false: bad values found late, a request that
failed alone inside its engine) is neither charged nor retried elsewhere. Load refusals (429,
503) are retried elsewhere without a charge.
Closing a choice always releases its slot and aborts it on its backend unless it finished.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, replace
from typing import AsyncIterator

from gateway.backend import GenerationRequest, TokenEvent, batched_events
from gateway.errors import APIError, BackendError, BackendTimeout, Overloaded, request_fault
from gateway.idle import IdleWatch
from gateway.pools.admission import Ticket
from gateway.pools.breaker import HALF_OPEN
from gateway.pools.registry import Deployment, ModelPool, ModelRegistry
from gateway.protocol.completions import ParsedRequest
from gateway.routing.policies import load_score

log = logging.getLogger("kvgate.choices")

# Refusals that say "busy", not "broken": try elsewhere, but do not charge the breaker.
@dataclass(eq=False)
class OpenChoice:
    index: int
    request: GenerationRequest
    pool: ModelPool
    deployment: Deployment
    events: AsyncIterator  # the backend's: TokenEvents, or lists of them when `batched`
    first: list[TokenEvent]
    batched: bool = False
    attempts: int = 1
    finished: bool = False
    closed: bool = False
    span: object = None  # the attempt's CLIENT span, when tracing
    recorder: object = None
    last_event: TokenEvent | None = None

    async def stream(self) -> AsyncIterator[list[TokenEvent]]:
        """The events in lists (those that arrived together, or one each from a backend that does
        not batch): the first, then the rest; each next must come within the idle timeout."""
        yield self._note(self.first)
        idle_s = self.pool.config.timeouts.idle_s
        idle = IdleWatch(idle_s)  # not wait_for (a task per token) nor asyncio.timeout (a timer per token)
        try:
            while not self.finished:
                try:
                    item = await idle.read(anext(self.events))
                except StopAsyncIteration:
                    return
                except Exception as exc:  # noqa: BLE001 - a backend bug must not leak a traceback
                    self.deployment.breaker.judge(exc, before_first_token=False)
                    if isinstance(exc, asyncio.TimeoutError):
                        raise BackendTimeout(f"The backend '{self.deployment.name}' sent nothing for {idle_s:g} s.") \
                            from None
                    if isinstance(exc, APIError):
                        raise
                    raise _backend_failure(self.deployment, exc) from exc
                if not self.batched:
                    yield self._note([item])
                elif item:
                    yield self._note(item)
        finally:
            idle.close()

    def _note(self, batch: list[TokenEvent]) -> list[TokenEvent]:
        """The batch up to its finishing event, if it has one (nothing after it is read)."""
        for i, event in enumerate(batch):
            if event.finish_reason:
                self.finished = True
                self.last_event = event
                return batch if i == len(batch) - 1 else batch[:i + 1]
        return batch

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        await _close_events(self.events)
        if not self.finished:
            await _abort(self.deployment, self.request.request_id)
        self.pool.release(self.deployment)
        if self.span is not None:
            self.recorder.attempt_done(self.span, self.last_event, self.finished)


def choice_requests(parsed: ParsedRequest, request_id: str, priority: int = 0,
                    trace_context: dict | None = None) -> list[GenerationRequest]:
    """One GenerationRequest per choice: prompts x n, each choice with its own seed offset."""
    # What every choice shares (the same objects, as dataclasses.replace of one base would give),
    # passed to each constructor: a replace per choice costs twice a construction.
    common = dict(
        model=parsed.model, user=parsed.user, priority=priority, trace_context=dict(trace_context or {}),
        stream=parsed.stream, tools=parsed.tools, tool_choice=parsed.tool_choice,
        parallel_tool_calls=parsed.parallel_tool_calls, response_format=parsed.response_format,
        reasoning_effort=parsed.reasoning_effort, extra=parsed.extra or {}, needs=parsed.needs,
        passthrough=parsed.passthrough, continuous_usage=parsed.continuous_usage, messages=parsed.messages,
    )
    inputs = parsed.prompts if parsed.prompts is not None else [None]
    out = []
    for p, prompt in enumerate(inputs):
        for i in range(parsed.n):
            index = p * parsed.n + i
            sampling = parsed.sampling
            if sampling.seed is not None and i:
                sampling = replace(sampling, seed=(sampling.seed + i) % 2**63)  # stays in range
            out.append(GenerationRequest(
                request_id=f"{request_id}-{index}" if parsed.num_choices > 1 else request_id,
                sampling=sampling, prompt=prompt, **common))
    return out


async def open_choices(registry: ModelRegistry, pool: ModelPool, requests: list[GenerationRequest],
                       ticket: Ticket, recorder, opener=None) -> list[OpenChoice]:
    """Open every choice (with `opener`, open_choice's signature; default open_choice); if any
    is refused, close the ones already open and re-raise."""
    opener = opener or open_choice
    opened: list[OpenChoice] = []
    try:
        for index, request in enumerate(requests):
            await pool.prepare_routing(request)
            opened.append(await opener(registry, pool, index, request, ticket, recorder))
    except BaseException:
        await asyncio.gather(*(c.close() for c in opened))
        raise
    return opened


async def open_choice(registry: ModelRegistry, pool: ModelPool, index: int, request: GenerationRequest,
                      ticket: Ticket, recorder) -> OpenChoice:
    """Admit the choice to `pool` (waiting in its queue if needed), then fail over: other
    deployments of the pool, then the fallback models, each without queueing."""

    async def attempt(current: ModelPool, deployment: Deployment, sent: GenerationRequest, span, attempts: int):
        choice = await open_on(current, deployment, index, sent)
        choice.attempts, choice.span, choice.recorder = attempts, span, recorder
        return choice

    return await with_failover(registry, pool, request, ticket, recorder, attempt)


async def with_failover(registry: ModelRegistry, pool: ModelPool, request, ticket: Ticket, recorder, attempt,
                        admitted: Deployment | None = None):
    """What `attempt(pool, deployment, request as sent, span, attempt number)` returns on the
    first deployment where it succeeds: `request` admitted to `pool` (waiting in its queue if
    needed; `admitted`: the deployment its admission already gave, gateway.dispatch.disagg), then on its
    other deployments, then on the fallback models' (without queueing).
    The deployment's slot is released here when an attempt fails; on success it is the
    attempt's to keep or release. An error the request caused ends the search at once."""
    deployment = admitted if admitted is not None else await admit(pool, request, ticket, recorder)
    last_error: APIError | None = None
    attempts = 0
    for current in pools_to_try(registry, pool):
        if current is not pool:
            deployment = current.take(request)
        tried: set[str] = set()
        while deployment is not None:
            tried.add(deployment.name)
            attempts += 1
            recorder.routed(current, deployment, scores(current) if recorder.trace is not None else None)
            span = recorder.attempt(deployment, deployment.upstream_model, attempts)
            try:
                result = await attempt(current, deployment, traced(request, recorder, span), span, attempts)
            except APIError as exc:
                current.release(deployment)
                recorder.attempt_failed(span, deployment, exc, retried=not request_fault(exc))
                if request_fault(exc):
                    recorder.refused_as_bad()
                    raise  # the request itself is bad: another backend will say the same
                last_error = exc
                log.warning("request %s failed on %s before its first token (%s); failing over",
                            request.request_id, deployment.name, exc.code)
            except BaseException:  # cancelled (the client left): give the slot back, then go
                current.release(deployment)
                recorder.attempt_failed(span, deployment, None, retried=False)
                raise
            else:
                if current is not pool:
                    recorder.fallback_used(current.name)
                return result
            deployment = current.take(request, exclude=frozenset(tried))
    raise last_error or Overloaded(f"No backend of model '{pool.name}' is available right now.", retry_after_s=5)


async def admit(pool: ModelPool, request: GenerationRequest, ticket: Ticket, recorder):
    started = time.monotonic()
    try:
        deployment = await pool.admission.acquire(request, ticket)
    except Overloaded as exc:
        recorder.shed(getattr(exc, "reason", "overloaded"))
        raise
    waited = time.monotonic() - started
    recorder.queued(waited, waited > 0.0005)
    return deployment


def give_back(pool: ModelPool, deployment: Deployment, probe: bool) -> None:
    """An admitted deployment's slot, unused: released, and its breaker's probe too when the
    grant claimed it (`probe`; else no request would ever probe the deployment back in)."""
    if probe:
        deployment.breaker.release_probe()
    pool.release(deployment)


def holds_probe(deployment: Deployment) -> bool:
    """Whether the slot just taken on `deployment` is its breaker's half-open probe."""
    return deployment.breaker.state == HALF_OPEN and deployment.breaker.probe_in_flight


def scores(pool: ModelPool, role: str = "decode") -> dict[str, float]:
    """The load scores of the pool's available deployments that take `role`'s hop (ModelPool.take)."""
    prefill = role == "prefill"
    return {d.name: load_score(d) for d in pool.deployments if d.available and (d.role == "prefill") == prefill}


def traced(request: GenerationRequest, recorder, span) -> GenerationRequest:
    """The request as this attempt sends it: the attempt span is the backend's parent."""
    if span is None:
        return request
    return replace(request, trace_context=recorder.trace.carrier(span))


def pools_to_try(registry: ModelRegistry, pool: ModelPool):
    """The pool, then its fallback chain (each model at most once)."""
    seen = {pool.name}
    current = pool
    yield pool
    while current.config.fallback:
        current = registry.get(current.config.fallback)
        if current is None or current.name in seen:
            return
        seen.add(current.name)
        yield current


async def open_on(pool: ModelPool, deployment: Deployment, index: int, request: GenerationRequest) -> OpenChoice:
    """`request` sent to `deployment`, open up to its first event; the slot (already claimed)
    stays the caller's to release when this raises."""
    request = _sent_as(request, deployment.upstream_model)
    events, batched = batched_events(deployment.backend, request)
    timeout = pool.config.timeouts.first_token_s
    try:
        async with asyncio.timeout(timeout):
            first = await anext(events)
            while batched and not first:  # an empty list is no output yet
                first = await anext(events)
    except BaseException as exc:
        deployment.breaker.judge(exc)
        if isinstance(exc, StopAsyncIteration):
            raise BackendError(f"Backend '{deployment.name}' ended the request without output.") from None
        if isinstance(exc, asyncio.TimeoutError):
            await _close_events(events)
            await _abort(deployment, request.request_id)
            raise BackendTimeout(f"The backend '{deployment.name}' sent no token within {timeout:g} s.") from None
        if isinstance(exc, Exception) and not isinstance(exc, APIError):
            raise _backend_failure(deployment, exc) from exc
        if not isinstance(exc, Exception):  # cancelled before the first token (the client left)
            await asyncio.shield(_give_up(deployment, events, request.request_id))
        raise
    deployment.breaker.record_success()
    return OpenChoice(index, request, pool, deployment, events, first if batched else [first], batched)


def _sent_as(request: GenerationRequest, model: str) -> GenerationRequest:
    """replace(request, model=model) for a fifth of its cost: a shallow copy of its fields
    (GenerationRequest is a plain dataclass with no __post_init__: nothing replace would run
    is skipped)."""
    sent = object.__new__(type(request))
    sent.__dict__.update(vars(request), model=model)
    return sent


async def _give_up(deployment: Deployment, events, request_id: str) -> None:
    """Stop a backend request nobody waits for any more, at once (not when it would finish)."""
    await _close_events(events)
    await _abort(deployment, request_id)


def _backend_failure(deployment: Deployment, exc: Exception) -> BackendError:
    log.error("backend %s failed: %s: %s", deployment.name, type(exc).__name__, exc)
    return BackendError(f"The backend '{deployment.name}' failed while generating.")


async def _close_events(events) -> None:
    try:
        await events.aclose()
    except Exception:  # noqa: BLE001
        log.debug("closing a backend stream raised", exc_info=True)


async def _abort(deployment: Deployment, request_id: str) -> None:
    try:
        await deployment.backend.abort(request_id)
    except Exception:  # noqa: BLE001
        log.warning("abort of %s on %s failed", request_id, deployment.name)


async def merged_events(choices: list[OpenChoice]) -> AsyncIterator[tuple[int, list[TokenEvent]]]:
    """Lists of events of all choices as they come, each tagged with its choice's index."""
    if len(choices) == 1:  # the common case, without tasks and queues
        async for batch in choices[0].stream():
            yield choices[0].index, batch
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(choice: OpenChoice) -> None:
        try:
            async for batch in choice.stream():
                await queue.put((choice.index, batch))
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            await queue.put((choice.index, exc))
            return
        await queue.put((choice.index, done))

    tasks = [asyncio.create_task(pump(c)) for c in choices]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
