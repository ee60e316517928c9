"""An idle limit on a stream without a timer per chunk.

`asyncio.timeout` around every read creates, schedules and cancels a timer per chunk: ~8 % of the
gateway's CPU on a streamed request (the openai adapter reads upstream chunks, and the gateway
reads every backend's token events, each under an idle limit). Here each read only notes when it began waiting; one timer
per stream fires at most once per idle period, checks, and either cancels the reading task (it
has waited the whole period) or re-arms itself for the rest of the current wait.
"""

from __future__ import annotations

import asyncio


class IdleWatch:
    def __init__(self, idle_s: float):
        self.idle_s = idle_s
        self._loop = asyncio.get_running_loop()
        self._task: asyncio.Task | None = None
        self._waiting_since: float | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._cancelled_by_us = False
        self._cancelling_before = 0

    async def read(self, awaitable):
        """Await `awaitable`; TimeoutError if it waits `idle_s` without an answer."""
        task = self._task = asyncio.current_task()
        self._cancelling_before = task.cancelling()
        self._waiting_since = self._loop.time()
        if self._timer is None:
            self._timer = self._loop.call_at(self._waiting_since + self.idle_s, self._check)
        try:
            return await awaitable
        except asyncio.CancelledError:
            # Ours only if we cancelled and nobody else did too (asyncio.timeout's rule).
            if self._cancelled_by_us and task.uncancel() <= self._cancelling_before:
                self._cancelled_by_us = False
                raise TimeoutError from None
            raise
        finally:
            self._waiting_since = None

    def _check(self) -> None:
        self._timer = None
        if self._waiting_since is None:
            return  # not reading now: the next read arms a timer again
        due = self._waiting_since + self.idle_s
        if self._loop.time() >= due:
            self._cancelled_by_us = True
            self._task.cancel()
        else:
            self._timer = self._loop.call_at(due, self._check)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
