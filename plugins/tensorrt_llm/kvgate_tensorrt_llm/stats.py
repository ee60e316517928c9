"""The engine's iteration stats (enable_iter_perf_stats) as the latest running count and KV use.

`LLM.get_stats_async(timeout)` (tensorrt_llm/llmapi/llm.py -> executor/executor.py `aget_stats`)
is a plain method returning one shared `IterationResult`: iterating it yields each iteration's
stats as a dict and consumes it, waits up to `timeout` for the next, then stops until a new request
is submitted. Before the first request there is no result yet: every call prints a warning and
returns an empty iterable, so an idle deployment polled every second would fill its log. Hence
this reader starts reading only once a request has been submitted, and is the only reader.
"""

from __future__ import annotations

import asyncio
import logging
import time

from kvgate_tensorrt_llm import mapping

log = logging.getLogger("kvgate.tensorrt_llm")


class IterationStats:
    def __init__(self, llm, poll_s: float, stale_s: float, deployment: str):
        self._llm = llm
        self.poll_s, self.stale_s, self.deployment = poll_s, stale_s, deployment
        self.submitted = False  # set by the backend when it hands the engine its first request
        self._latest: dict | None = None
        self._at = 0.0

    def latest(self) -> dict | None:
        """{running, queued, kv_cache_usage}, or None when there are none recent enough."""
        if self._latest is None or time.monotonic() - self._at > self.stale_s:
            return None
        return self._latest

    async def run(self) -> None:
        while True:
            if self.submitted:
                await self._drain()
            await asyncio.sleep(self.poll_s)

    async def _drain(self) -> None:
        """Read until the engine has had nothing new for `poll_s` (also keeps its queue short)."""
        try:
            async for stat in self._llm.get_stats_async(timeout=self.poll_s):
                parsed = mapping.kv_stats(stat)
                if parsed is not None:
                    self._latest, self._at = parsed, time.monotonic()
        except Exception as exc:  # noqa: BLE001 - stats are advisory
            log.debug("deployment %s: stats read failed: %s", self.deployment, exc)
