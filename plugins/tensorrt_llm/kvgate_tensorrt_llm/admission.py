"""A bounded gate in front of the engine that lets requests in by priority (lower first).

TensorRT-LLM 1.2.x has no per-request priority: everything handed to `generate_async` is
scheduled first come, first served. So at most `limit` requests are in the engine at once, and
the others wait here, ordered by (priority, arrival), which carries our SLA class into admission.

    waiting (heap by priority, arrival)          in the engine (<= limit)
    [(0, 7), (0, 9), (3, 8), (5, 6)]  --grant-->  {r1, r2, ...}  --release-->  grant the next

Every arrival joins the heap and the heap is granted from at once, so a waiter that was aborted
or cancelled (its future done, its entry not yet popped) never makes a newcomer wait while there
is room: grants skip such entries, and only live waiters count as waiting.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools


class Aborted(Exception):
    """The request was aborted while it waited."""


class PriorityAdmission:
    def __init__(self, limit: int):
        self.limit = limit
        self.running = 0
        self._heap: list[tuple[int, int, asyncio.Future]] = []
        self._waiters: dict[str, asyncio.Future] = {}
        self._arrival = itertools.count()

    @property
    def waiting(self) -> int:
        return sum(1 for future in self._waiters.values() if not future.done())

    async def acquire(self, request_id: str, priority: int) -> None:
        """Return once the request may enter the engine; raises Aborted if abort() came first."""
        future = asyncio.get_running_loop().create_future()
        heapq.heappush(self._heap, (priority, next(self._arrival), future))
        self._waiters[request_id] = future
        self._grant()
        try:
            await future  # already done when it was granted at once: no suspension
        except BaseException:
            if future.done() and not future.cancelled() and future.exception() is None:
                self.release()  # granted and cancelled in the same instant: pass the slot on
            raise
        finally:
            if self._waiters.get(request_id) is future:
                del self._waiters[request_id]

    def release(self) -> None:
        self.running -= 1
        self._grant()

    def abort(self, request_id: str) -> bool:
        """Wake a waiting request with Aborted; False if it is not waiting."""
        future = self._waiters.pop(request_id, None)
        if future is None or future.done():
            return False
        future.set_exception(Aborted(request_id))
        return True

    def _grant(self) -> None:
        while self._heap and self.running < self.limit:
            *_, future = heapq.heappop(self._heap)
            if not future.done():  # skip the ones aborted or cancelled while they waited
                self.running += 1
                future.set_result(None)
