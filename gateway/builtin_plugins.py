"""The gateway's own features, registered through the same hooks a third party uses."""

from __future__ import annotations

import itertools

from gateway.hookspecs import hookimpl


class RoundRobin:
    """Each request goes to the next healthy deployment in turn."""

    def __init__(self, options: dict):
        self._counter = itertools.count()

    def choose(self, request, candidates):
        return candidates[next(self._counter) % len(candidates)]


@hookimpl
def register_routing_policies(register):
    register("round_robin", RoundRobin)
