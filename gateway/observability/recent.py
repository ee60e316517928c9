"""Recent activity for the status page: the last latencies and errors, in bounded deques."""

from __future__ import annotations

import time
from collections import deque

WINDOW = 2000  # recent latency samples kept for percentiles


class RecentActivity:
    """Recent latencies and errors for the status page (bounded deques: O(1) appends)."""

    def __init__(self):
        self.ttft: deque[float] = deque(maxlen=WINDOW)
        self.tpot: deque[float] = deque(maxlen=WINDOW)
        self.errors: deque[dict] = deque(maxlen=20)
        self.requests = 0
        self.failed = 0
        self.cancelled = 0  # clients that went away (499): not a failure of the service

    def finished(self, model: str, status, error: str | None, key: str | None = None) -> None:
        self.requests += 1
        if status == 499:
            self.cancelled += 1
        elif status != 200:
            self.failed += 1
            self.errors.appendleft({"time": time.time(), "model": model, "status": status,
                                    "message": error or f"status {status}", "key": key})


def percentile(values, q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
