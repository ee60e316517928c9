"""Whether a shared Redis answers, for the stores that count on this replica alone while it does not
(per-key limits: keys.redis_limiter; budgets: budgets.redis_store).

    up ── a call fails ──> down: logged once, a probe task pings every PROBE_S
    ^                            │
    └──── a ping answers ────────┘ logged once, shared again
"""

from __future__ import annotations

import asyncio
import logging
import time

from redis.exceptions import RedisError

PROBE_S = 1.0  # while Redis is down, how often it is tried again


class RedisHealth:
    """`up`, what went wrong (`problem`) and since when; `went_down` starts the probe that sets
    `up` again. `store` names the store in its log lines; `alone` and `shared` say what an outage
    and its end mean for the requests ("each replica enforces the limits alone")."""

    def __init__(self, redis, log: logging.Logger, store: str, alone: str, shared: str):
        self.redis = redis
        self.log, self.store, self.alone, self.shared = log, store, alone, shared
        self.up = True
        self.problem: str | None = None
        self.since = time.time()  # when `up` last changed
        self._probe: asyncio.Task | None = None

    def went_down(self, exc: BaseException) -> None:
        """A Redis call failed with `exc`: from now on the store counts locally, until a ping answers."""
        if not self.up:
            return
        self.up, self.since = False, time.time()
        self.problem = f"Redis unreachable ({type(exc).__name__}: {exc}); {self.alone}"
        self.log.warning("%s: %s", self.store, self.problem)
        self._probe = asyncio.get_running_loop().create_task(self._probe_until_up())

    async def _probe_until_up(self) -> None:
        while not self.up:
            await asyncio.sleep(PROBE_S)
            try:
                await self.redis.ping()
            except (RedisError, OSError):
                continue
            self.up, self.since, self.problem = True, time.time(), None
            self.log.warning("%s: Redis answers again; %s", self.store, self.shared)

    def stop(self) -> None:
        if self._probe is not None:
            self._probe.cancel()

    def status(self) -> dict:
        """For the status page, /status.json and the store's `_up` gauge."""
        return {"kind": "redis", "shared": self.up, "problem": self.problem, "since": self.since}
