"""Admission to a pool: take a deployment now, wait in a bounded priority queue, or be refused.

A request is placed at once when some deployment can take it. When no deployment is up at all
(not started, dead, or cut off by its breaker) it is refused at once. Otherwise the pool is
saturated, and then:
- a sheddable class is refused at once (503, Retry-After): it never waits behind others;
- any other class waits in the pool's queue, ordered by SLA priority then arrival, and is refused
  when the queue is full (so the queue only ever holds classes that may not be shed);
- a waiter still queued after its class's max wait is refused with a message saying so.
Refusals return within milliseconds; nobody waits for a timeout to learn the pool is full.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from dataclasses import dataclass, field

from gateway.errors import Overloaded
from gateway.pools.breaker import HALF_OPEN

RECHECK_S = 0.02  # backends' load changes without telling us: waiters re-check this often


@dataclass(frozen=True)
class Ticket:
    """Who is asking: the SLA class's priority (lower first), whether it may be shed, and how
    long it may wait."""

    priority: int
    sheddable: bool
    max_wait_s: float
    sla_class: str = "standard"


@dataclass(order=True)
class _Waiter:
    priority: int
    seq: int
    ticket: Ticket = field(compare=False)
    request: object = field(compare=False)
    future: asyncio.Future = field(compare=False)
    # Its grant claimed a half-open deployment's one probe (take() picks a half-open deployment
    # only while no probe is out, and claims it): a grant nobody uses must give it back.
    probe: bool = field(default=False, compare=False)


class PoolAdmission:
    def __init__(self, pool, max_queue: int):
        self.pool = pool
        self.max_queue = max_queue
        self._heap: list[_Waiter] = []
        self._seq = itertools.count()
        self._recheck: asyncio.TimerHandle | None = None
        self.shed_count = 0

    @property
    def queued(self) -> int:
        return sum(1 for w in self._heap if not w.future.done())

    async def acquire(self, request, ticket: Ticket):
        """A deployment for `request`, its in-flight slot already taken."""
        if not self.queued:
            deployment = self.pool.take(request)
            if deployment is not None:
                return deployment
        if not self.pool.any_available(request.needs):
            # Nothing is busy, everything is down: waiting would only delay the same answer.
            raise _refusal(f"No backend of model '{self.pool.name}' is available right now.", "unavailable", 5)
        if ticket.sheddable:
            self.shed_count += 1
            raise _refusal(f"Model '{self.pool.name}' is saturated; class '{ticket.sla_class}' is shed first.", "shed")
        waiter = self._enqueue(request, ticket)
        return await self._wait(waiter, ticket)

    def _enqueue(self, request, ticket: Ticket) -> _Waiter:
        if self.queued >= self.max_queue:
            self.shed_count += 1
            raise _refusal(f"The queue of model '{self.pool.name}' is full.", "queue_full")
        loop = asyncio.get_running_loop()
        waiter = _Waiter(ticket.priority, next(self._seq), ticket, request, loop.create_future())
        heapq.heappush(self._heap, waiter)
        self._schedule_recheck()
        return waiter

    async def _wait(self, waiter: _Waiter, ticket: Ticket):
        started = time.monotonic()
        try:
            return await asyncio.wait_for(asyncio.shield(waiter.future), ticket.max_wait_s)
        except asyncio.TimeoutError:
            pass
        except asyncio.CancelledError:
            self._forget(waiter)
            raise
        if waiter.future.done() and not waiter.future.exception():
            return waiter.future.result()  # granted at the very moment the wait ran out
        self._forget(waiter)
        waited = time.monotonic() - started
        raise _refusal(
            f"The request waited {waited:.1f} s for model '{self.pool.name}', over the "
            f"{ticket.max_wait_s:g} s allowed for class '{ticket.sla_class}'.", "queue_timeout")

    def _forget(self, waiter: _Waiter) -> None:
        """A waiter leaves (cancelled, or out of time): out of the heap now, so churn cannot grow it."""
        if waiter.future.done() and not waiter.future.cancelled() and not waiter.future.exception():
            deployment = waiter.future.result()  # granted, but nobody will use it
            if waiter.probe:  # else the deployment is never routed to again: no probe, no verdict
                deployment.breaker.release_probe()
            self.pool.release(deployment)
        elif not waiter.future.done():
            waiter.future.cancel()
        try:
            self._heap.remove(waiter)  # O(queue): the queue is bounded and small
        except ValueError:
            return  # already popped by wake()
        heapq.heapify(self._heap)

    def wake(self) -> None:
        """Grant queued requests, best first, as long as deployments can take them."""
        while self._heap:
            waiter = self._heap[0]
            if waiter.future.done():
                heapq.heappop(self._heap)
                continue
            deployment = self.pool.take(waiter.request)
            if deployment is None:
                break
            heapq.heappop(self._heap)
            waiter.probe = deployment.breaker.state == HALF_OPEN
            waiter.future.set_result(deployment)
        self._schedule_recheck()

    def _schedule_recheck(self) -> None:
        if self._recheck is not None or not self.queued:
            return
        loop = asyncio.get_running_loop()

        def recheck():
            self._recheck = None
            self.wake()

        self._recheck = loop.call_later(RECHECK_S, recheck)


def _refusal(message: str, reason: str, retry_after_s: float = 2) -> Overloaded:
    """A 503 that also says why, for the shed-requests metric (reason is not sent to clients)."""
    error = Overloaded(message, retry_after_s=retry_after_s)
    error.reason = reason
    return error
