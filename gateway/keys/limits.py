"""Per-key limits in this process: requests/min, tokens/min and concurrency in sliding 60 s windows.

`keys/redis_limiter.py` has the same interface with the counts in Redis, shared by every replica.
"""

from __future__ import annotations

import time
from collections import deque

from gateway.errors import InvalidRequestError, RateLimited
from gateway.keys.store import ApiKey


class _Window:
    """Events in the last 60 s, each with a weight (1 per request, or a token count)."""

    def __init__(self):
        self.events: deque[list] = deque()  # [time, weight]; a refunded reservation's weight drops
        self.total = 0

    def trim(self, now: float) -> None:
        while self.events and now - self.events[0][0] >= 60.0:
            self.total -= self.events.popleft()[1]

    def add(self, now: float, weight: int) -> list:
        event = [now, weight]
        self.events.append(event)
        self.total += weight
        return event

    def refund(self, event: list, now: float) -> None:
        """Take back an event's weight, unless it has already left the window."""
        self.trim(now)
        if now - event[0] < 60.0:
            self.total -= event[1]
            event[1] = 0

    def seconds_until_below(self, limit: int, now: float) -> float:
        """How long until the total drops under `limit` as old events expire."""
        total = self.total
        for t, w in self.events:
            total -= w
            if total < limit:
                return max(0.0, 60.0 - (now - t))
        return 60.0


def check_weight(key: ApiKey, weight: int) -> None:
    """A request larger than the key's whole minute can never pass: a 400, not a 429."""
    if key.requests_per_minute and weight > key.requests_per_minute:
        raise InvalidRequestError(f"This request has {weight} choices (prompts x n), more than the "
                                  f"{key.requests_per_minute} requests per minute of key '{key.name}'.",
                                  param="n")


class KeyLimiter:
    """Requests/min, tokens/min and concurrency per key name, in sliding 60 s windows.

    Kept across config reloads (state is by key name), so a reload does not reset anyone's budget.
    """

    def __init__(self, clock=time.monotonic):
        self.clock = clock
        self._requests: dict[str, _Window] = {}
        self._tokens: dict[str, _Window] = {}
        self._in_flight: dict[str, int] = {}
        # Per key, the token reservations of requests in flight, oldest first (a key's requests
        # are interchangeable for counting: finish refunds the oldest).
        self._reserved: dict[str, deque[list]] = {}

    def admit(self, key: ApiKey, weight: int = 1, reserve_tokens: int = 0) -> None:
        """Count a new request of `weight` choices (prompts x n) against `key`, or raise 429 with
        how long to wait. A request larger than the key's whole minute can never pass.
        `reserve_tokens` (the most it can generate) is charged to the key's tokens now, so a burst
        of requests cannot all pass a budget none of them has used yet; `finish` refunds it."""
        now = self.clock()
        check_weight(key, weight)
        self._check(key, weight, now)
        self._requests[key.name].add(now, weight)
        self._in_flight[key.name] = self._in_flight.get(key.name, 0) + 1
        # Admitted while the key is under its minute (one request may end over it), and charged
        # at most the whole minute, so a long max_tokens does not lock the key out for longer.
        reserve_tokens = min(reserve_tokens, key.tokens_per_minute or 0)
        if reserve_tokens:
            self._reserved.setdefault(key.name, deque()).append(self._tokens[key.name].add(now, reserve_tokens))

    def check(self, key: ApiKey) -> None:
        """Raise 429 when `key` is at one of its limits now, counting nothing: the serving path
        asks before it reads and parses a body, so a key at its limit costs no parsing."""
        self._check(key, 1, self.clock())

    async def admissible(self, key: ApiKey) -> None:
        """`check` as the serving path calls it (a shared store answers over the network)."""
        self.check(key)

    def count_refused(self, key: ApiKey) -> None:
        """A request of `key` refused before admission (a 4xx): it still counts as a request."""
        if key.requests_per_minute:
            self._requests.setdefault(key.name, _Window()).add(self.clock(), 1)

    def _check(self, key: ApiKey, weight: int, now: float) -> None:
        requests = self._requests.setdefault(key.name, _Window())
        tokens = self._tokens.setdefault(key.name, _Window())
        requests.trim(now)
        tokens.trim(now)
        if key.requests_per_minute and requests.total + weight > key.requests_per_minute:
            wait = requests.seconds_until_below(key.requests_per_minute - weight + 1, now)
            raise RateLimited(f"Rate limit of {key.requests_per_minute} requests per minute reached for key '{key.name}'.",
                              retry_after_s=wait)
        if key.tokens_per_minute and tokens.total >= key.tokens_per_minute:
            wait = tokens.seconds_until_below(key.tokens_per_minute, now)
            raise RateLimited(f"Rate limit of {key.tokens_per_minute} tokens per minute reached for key '{key.name}'.",
                              retry_after_s=wait)
        in_flight = self._in_flight.get(key.name, 0)
        if key.max_concurrency and in_flight >= key.max_concurrency:
            raise RateLimited(f"Key '{key.name}' already has {in_flight} requests in flight (its limit).",
                              retry_after_s=1)

    async def acquire(self, key: ApiKey, weight: int = 1, reserve_tokens: int = 0) -> None:
        """`admit` as the serving path calls it (a shared store answers over the network)."""
        self.admit(key, weight, reserve_tokens)

    def finish(self, key: ApiKey, tokens: int) -> None:
        self.release(key)
        reserved = self._reserved.get(key.name)
        if reserved:
            self._tokens[key.name].refund(reserved.popleft(), self.clock())
            if not reserved:
                del self._reserved[key.name]
        self.charge(key, tokens)

    def release(self, key: ApiKey) -> None:
        """One of the key's requests is no longer in flight."""
        self._in_flight[key.name] = max(0, self._in_flight.get(key.name, 0) - 1)

    def charge(self, key: ApiKey, tokens: int) -> None:
        """Count `tokens` (prompt + completion of every choice) against the key's minute."""
        if tokens:
            self._tokens.setdefault(key.name, _Window()).add(self.clock(), tokens)

    async def start(self) -> None:
        """Nothing to connect to: the windows live in this process."""

    async def stop(self) -> None:
        pass

    def status(self) -> dict:
        return {"kind": "memory", "shared": False, "problem": None}
