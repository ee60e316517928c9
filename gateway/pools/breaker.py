"""A per-deployment circuit breaker: out after repeated failures, probed back in after a cool-down.

    closed --(N consecutive failures)--> open --(cool-down passed)--> half-open
      ^                                    ^                              |
      +-------- probe succeeded -----------+------- probe failed ---------+

In half-open state exactly one request (the probe) is let through; its outcome decides.

A backend that replaces its serving process (the native plugin restarts a dead or hung engine)
says so by a new `LoadSnapshot.incarnation`. The failures counted so far belong to the process
that is gone, and the new one has just proved it is up, so the breaker starts over closed: the
first request after the restart is served, not refused for the rest of a cool-down.
"""

from __future__ import annotations

import time
from typing import Callable

from gateway.errors import APIError

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"


class CircuitBreaker:
    def __init__(self, failures: int, cooldown_s: float, clock: Callable[[], float] = time.monotonic,
                 incarnation: Callable[[], int] = lambda: 0):
        self.threshold = failures
        self.cooldown_s = cooldown_s
        self.clock = clock
        self.consecutive_failures = 0
        self.opened_at: float | None = None
        self.probe_in_flight = False
        self.times_opened = 0
        self._incarnation = incarnation  # which serving process the backend runs now
        self._counted_for: int | None = None  # the process the counts above are about

    @property
    def state(self) -> str:
        # Only an open breaker holds anything a restart clears (record_failure checks for itself),
        # so a closed one, read on every routing decision, costs no backend.load() here.
        if self.opened_at is not None:
            self._forget_replaced_process()
        if self.opened_at is None:
            return CLOSED
        if self.clock() - self.opened_at < self.cooldown_s:
            return OPEN
        return HALF_OPEN

    def allows(self) -> bool:
        """May a request be sent now? (Does not claim the probe; see `claim`.)"""
        state = self.state
        return state == CLOSED or (state == HALF_OPEN and not self.probe_in_flight)

    def claim(self) -> None:
        """Called when a request is actually sent; in half-open state it becomes the probe."""
        if self.state == HALF_OPEN:
            self.probe_in_flight = True

    def _forget_replaced_process(self) -> None:
        current, counted_for = self._incarnation(), self._counted_for
        self._counted_for = current
        if counted_for is not None and current != counted_for:
            self.consecutive_failures = 0
            self.opened_at = None
            self.probe_in_flight = False

    def record_success(self) -> None:
        self.consecutive_failures = 0
        self.opened_at = None
        self.probe_in_flight = False

    def record_failure(self) -> None:
        self._forget_replaced_process()  # a failure of the new process starts a new count
        self.consecutive_failures += 1
        was_probe = self.probe_in_flight
        self.probe_in_flight = False
        if was_probe or self.consecutive_failures >= self.threshold:
            if self.opened_at is None or was_probe:
                self.times_opened += 1
            self.opened_at = self.clock()

    def inherit(self, other: "CircuitBreaker") -> None:
        """Take another breaker's verdict (the same upstream, back under a new member): an open
        breaker stays open, and its failures keep counting."""
        self.consecutive_failures = other.consecutive_failures
        self.opened_at = other.opened_at
        self.times_opened = other.times_opened

    def release_probe(self) -> None:
        """A probe that ended with neither verdict (client went away): let another probe in."""
        self.probe_in_flight = False

    def judge(self, exc: BaseException, *, before_first_token: bool = True) -> None:
        """What an attempt that raised `exc` says of its backend: a timeout, a backend's fault or
        a bug (any other exception) is a failure; the request's own error, a load refusal or a
        cancellation (the client left) is no verdict, and a half-open probe is given back. After
        the first token the attempt has already been judged a success, and holds no probe."""
        if backend_at_fault(exc):
            self.record_failure()
        elif before_first_token:
            self.release_probe()


def backend_at_fault(exc: BaseException) -> bool:
    if isinstance(exc, APIError):
        return exc.backend_fault
    return isinstance(exc, Exception)  # not a cancellation (BaseException)
