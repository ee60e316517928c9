"""Spend counted in this process: one gateway, or a replica while the shared store is down.

A store answers two calls for a request's whole set of budgets at once, so a request passes all
of them or none: `reserve` (check that each has room for the request's bound, and hold it) and
`settle` (drop the hold, count what was used). Every charge is a `Charge`: a budget's name, the
subject it counts for, its window, and an amount.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass


@dataclass
class Charge:
    budget: str
    subject: str  # "key=alice", "team=ml"
    window: str  # the calendar window's start, or "roll"
    limit: float
    amount: float  # reserved at admission; at settle, what was used
    held: float = 0.0  # at settle: what was reserved
    shadow: bool = False
    period_s: float = 0.0  # rolling windows
    ttl_s: float = 0.0  # calendar windows: how long the counter outlives now

    @property
    def slot(self) -> tuple[str, str]:
        return self.budget, self.subject


@dataclass
class Verdict:
    """A reservation's answer: the first budget without room (None: admitted), each budget's
    spend and holds before this request, and for a refusal the seconds until it has room."""

    refused: int | None
    spent: list[float]
    held: list[float]
    wait_s: float = 0.0


class MemoryStore:
    kind = "memory"

    def __init__(self, reservation_ttl_s: float = 3600.0, clock=time.time):
        self.clock = clock
        self.reservation_ttl_s = reservation_ttl_s
        self._spent: dict[tuple[str, str, str], float] = {}  # (budget, subject, window) -> spend
        self._events: dict[tuple[str, str], deque[list]] = {}  # rolling: [time, amount], oldest first
        self._holds: dict[tuple[str, str], dict[str, tuple[float, float]]] = {}  # id -> (amount, deadline)

    async def reserve(self, request_id: str, charges: list[Charge]) -> Verdict:
        now = self.clock()
        spent = [self._spend(c, now) for c in charges]
        held = [self._held(c, now) for c in charges]
        for i, c in enumerate(charges):
            if not c.shadow and spent[i] + held[i] + c.amount > c.limit:
                return Verdict(i, spent, held, self._wait(c, spent[i] + held[i] + c.amount - c.limit, now))
        for c in charges:
            self._holds.setdefault(c.slot, {})[request_id] = (c.amount, now + self.reservation_ttl_s)
        return Verdict(None, spent, held)

    async def settle(self, request_id: str, charges: list[Charge]) -> list[float]:
        """Drop the request's holds and count `charges`; each budget's spend after it."""
        now = self.clock()
        out = []
        for c in charges:
            self._holds.get(c.slot, {}).pop(request_id, None)
            if c.period_s:
                self._spend(c, now)
                if c.amount:
                    self._events.setdefault(c.slot, deque()).append([now, c.amount])
            elif c.amount:
                where = (c.budget, c.subject, c.window)
                self._spent[where] = self._spent.get(where, 0.0) + c.amount
            out.append(self._spend(c, now))
        return out

    async def read(self, charges: list[Charge]) -> list[tuple[float, float]]:
        """(spend, held) of each budget now, counting nothing."""
        now = self.clock()
        return [(self._spend(c, now), self._held(c, now)) for c in charges]

    def _spend(self, c: Charge, now: float) -> float:
        if not c.period_s:
            return self._spent.get((c.budget, c.subject, c.window), 0.0)
        events = self._events.get(c.slot)
        while events and events[0][0] <= now - c.period_s:
            events.popleft()
        return sum(e[1] for e in events) if events else 0.0

    def _held(self, c: Charge, now: float) -> float:
        holds = self._holds.get(c.slot)
        if not holds:
            return 0.0
        for rid in [rid for rid, (_, deadline) in holds.items() if deadline <= now]:
            del holds[rid]  # a reservation nobody settled: its request is long gone
        return sum(amount for amount, _ in holds.values())

    def _wait(self, c: Charge, over: float, now: float) -> float:
        """Seconds until `over` of the budget's spend has left its window."""
        if not c.period_s:
            return c.ttl_s
        for t, amount in self._events.get(c.slot, ()):
            over -= amount
            if over <= 0:
                return max(0.0, t + c.period_s - now)
        return c.period_s

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    def status(self) -> dict:
        return {"kind": "memory", "shared": False, "problem": None}
