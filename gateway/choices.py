"""Running the choices of one request on backends.

Every choice is opened (deployment chosen, first event awaited) before the response starts, so a
refusal (bad input, context too long, overloaded, backend down) is still an ordinary HTTP error.
After that, a failure can only end the stream. Closing a choice always aborts it on its backend,
whether it ended, failed, or the client went away.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, replace
from typing import AsyncIterator

from gateway.backend import GenerationRequest, TokenEvent
from gateway.errors import APIError, BackendError
from gateway.models import Deployment, ModelPool
from gateway.schemas import ParsedRequest

log = logging.getLogger("kvgate.choices")


@dataclass
class OpenChoice:
    index: int
    request: GenerationRequest
    deployment: Deployment
    events: AsyncIterator[TokenEvent]
    first: TokenEvent
    finished: bool = False

    async def stream(self) -> AsyncIterator[TokenEvent]:
        """The first event, then the rest; backend exceptions become `APIError`s."""
        yield self._note(self.first)
        try:
            async for event in self.events:
                yield self._note(event)
        except APIError:
            raise
        except Exception as exc:  # noqa: BLE001 - a backend bug must not leak a traceback
            raise _backend_failure(self.deployment, exc) from exc

    def _note(self, event: TokenEvent) -> TokenEvent:
        if event.finish_reason:
            self.finished = True
        return event

    async def close(self) -> None:
        try:
            await self.events.aclose()
        except Exception:  # noqa: BLE001
            log.debug("closing choice %s raised", self.request.request_id, exc_info=True)
        if not self.finished:
            try:
                await self.deployment.backend.abort(self.request.request_id)
            except Exception:  # noqa: BLE001
                log.warning("abort of %s on %s failed", self.request.request_id, self.deployment.name)


def choice_requests(parsed: ParsedRequest, request_id: str) -> list[GenerationRequest]:
    """One GenerationRequest per choice: prompts x n, each choice with its own seed offset."""
    base = GenerationRequest(
        request_id=request_id, model=parsed.model, sampling=parsed.sampling, user=parsed.user
    )
    inputs = parsed.prompts if parsed.prompts is not None else [None]
    out = []
    for p, prompt in enumerate(inputs):
        for i in range(parsed.n):
            index = p * parsed.n + i
            sampling = parsed.sampling
            if sampling.seed is not None and i:
                sampling = replace(sampling, seed=sampling.seed + i)
            out.append(
                replace(
                    base,
                    request_id=f"{request_id}-{index}" if parsed.num_choices > 1 else request_id,
                    sampling=sampling,
                    prompt=prompt,
                    messages=parsed.messages,
                )
            )
    return out


async def open_choices(pool: ModelPool, requests: list[GenerationRequest]) -> list[OpenChoice]:
    """Open every choice; if any is refused, close the ones already open and re-raise."""
    opened: list[OpenChoice] = []
    try:
        for index, request in enumerate(requests):
            opened.append(await _open_one(pool, index, request))
    except BaseException:
        await asyncio.gather(*(c.close() for c in opened))
        raise
    return opened


async def _open_one(pool: ModelPool, index: int, request: GenerationRequest) -> OpenChoice:
    deployment = pool.choose(request)
    request = replace(request, model=deployment.upstream_model)
    events = deployment.backend.generate(request)
    try:
        first = await anext(events)
    except StopAsyncIteration:
        raise BackendError(f"Backend '{deployment.name}' ended the request without output.") from None
    except APIError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise _backend_failure(deployment, exc) from exc
    return OpenChoice(index, request, deployment, events, first)


def _backend_failure(deployment: Deployment, exc: Exception) -> BackendError:
    log.error("backend %s failed: %s: %s", deployment.name, type(exc).__name__, exc)
    return BackendError(f"The backend '{deployment.name}' failed while generating.")


async def merged_events(choices: list[OpenChoice]) -> AsyncIterator[tuple[int, TokenEvent]]:
    """Events of all choices as they come, tagged with the choice index."""
    if len(choices) == 1:  # the common case, without tasks and queues
        async for event in choices[0].stream():
            yield choices[0].index, event
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(choice: OpenChoice) -> None:
        try:
            async for event in choice.stream():
                await queue.put((choice.index, event))
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
