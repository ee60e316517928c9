"""Keeps a deployment's engine process running.

    start ──> up ──(engine died / hung: in-flight requests failed)──> restarting ──> up
                                     │                                      │
                                     └── N deaths within the window ──> failed (stays down)

A death is anything that ends the process: a crash, a kill, the watchdog's verdict on a hung
step, or a restart that did not come up. Each restart waits longer than the last (back-off,
capped), counted over the deaths in the window, so a flapping engine does not spin. `failed`
is for the operator: the gateway's liveness probe then fails, and Kubernetes restarts the pod.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable

from pydantic import BaseModel, ConfigDict, Field

from native_backend.process.client import AsyncEngineClient
from native_backend.process.protocol import EngineStartupError

log = logging.getLogger("kvgate.native")

STARTING, UP, RESTARTING, FAILED, STOPPED = "starting", "up", "restarting", "failed", "stopped"


class SupervisionSettings(BaseModel):
    """How the native plugin watches and restarts its engine process."""

    model_config = ConfigDict(extra="forbid")

    watchdog_s: float = Field(120.0, gt=2, description="Seconds without a word from a started engine "
                              "(a step that long, or a stopped process) before it is killed and restarted.")
    backoff_s: float = Field(1.0, gt=0, description="Wait before the first restart; doubles with each "
                             "death in the window.")
    max_backoff_s: float = Field(60.0, gt=0, description="Longest wait before a restart.")
    max_deaths: int = Field(5, ge=1, description="Deaths within window_s after which the engine stays down "
                            "(and liveness fails).")
    window_s: float = Field(600.0, gt=0, description="The crash-loop window, in seconds.")


class EngineSupervisor:
    """Owns the current AsyncEngineClient; builds a new one after each death."""

    def __init__(self, make_client: Callable[[Callable[[str], None]], AsyncEngineClient], name: str,
                 settings: SupervisionSettings, clock: Callable[[], float] = time.monotonic):
        self._make_client = make_client  # (on_exit) -> a fresh, unstarted client
        self.name = name
        self.settings = settings
        self.clock = clock
        self.client: AsyncEngineClient | None = None
        self.state = STOPPED
        self.restarts = 0  # restarts begun since start()
        self.incarnation = 0  # engines that came up: 1 after start(), +1 after each restart
        self.last_cause: str | None = None  # why the engine last died
        self.crash_looped = False  # too many deaths in the window: it stays down
        self._deaths: deque[float] = deque()
        self._restart_task: asyncio.Task | None = None

    @property
    def up(self) -> bool:
        return self.state == UP and self.client is not None and self.client.is_alive

    async def start(self) -> None:
        """First start: a failure here is the deployment's start error (no retry)."""
        self.state = STARTING
        self.client = self._make_client(self._on_exit)
        try:
            await self.client.start()
        except BaseException:
            self.state = FAILED
            raise
        self.state = UP
        self.incarnation += 1

    async def stop(self) -> None:
        self.state = STOPPED
        if self._restart_task is not None:
            self._restart_task.cancel()
            await asyncio.gather(self._restart_task, return_exceptions=True)
        if self.client is not None:
            await self.client.shutdown()

    def _on_exit(self, cause: str) -> None:
        """Called in the event loop when the current engine process is gone."""
        if self.state in (STOPPED, STARTING):
            return  # shutting down, or the first start's failure (raised by start())
        self.last_cause = cause
        delay = self._note_death()
        if delay is None:
            self.state = FAILED
            self.crash_looped = True
            log.error("native deployment '%s': engine died %d times within %g s (last: %s); it stays down",
                      self.name, len(self._deaths), self.settings.window_s, cause)
            return
        self.state = RESTARTING
        log.error("native deployment '%s': engine died (%s); restart %d in %.1f s",
                  self.name, cause, self.restarts + 1, delay)
        self._restart_task = asyncio.get_running_loop().create_task(self._restart(delay))

    def _note_death(self) -> float | None:
        """Record a death; the back-off before the next restart, or None in a crash loop."""
        now = self.clock()
        self._deaths.append(now)
        while self._deaths and now - self._deaths[0] > self.settings.window_s:
            self._deaths.popleft()
        if len(self._deaths) >= self.settings.max_deaths:
            return None
        return min(self.settings.max_backoff_s, self.settings.backoff_s * 2 ** (len(self._deaths) - 1))

    async def _restart(self, delay: float) -> None:
        await asyncio.sleep(delay)
        self.restarts += 1
        client = self._make_client(self._on_exit)
        self.client = client
        try:
            await client.start()
        except EngineStartupError:
            return  # its exit already went through _on_exit: counted, and retried or given up
        except asyncio.CancelledError:
            raise
        if self.state == RESTARTING and client is self.client:
            self.state = UP
            self.incarnation += 1
            log.info("native deployment '%s': engine is back (restart %d)", self.name, self.restarts)
