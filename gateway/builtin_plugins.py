"""The gateway's own features, registered through the same hooks a third party uses."""

from __future__ import annotations

from gateway.hookspecs import hookimpl
from gateway.prefix_routing import PrecisePrefix
from gateway.routing import BUILTIN_POLICIES


@hookimpl
def register_routing_policies(register):
    for name, factory in BUILTIN_POLICIES.items():
        register(name, factory)
    register("precise_prefix", PrecisePrefix)
