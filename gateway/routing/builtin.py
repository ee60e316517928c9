"""The gateway's own features, registered through the same hooks a third party uses."""

from __future__ import annotations

from gateway.hookspecs import hookimpl
from gateway.routing.lora_affinity import LoRAAffinity
from gateway.routing.policies import BUILTIN_POLICIES
from gateway.routing.precise_prefix import PrecisePrefix


@hookimpl
def register_routing_policies(register):
    for name, factory in BUILTIN_POLICIES.items():
        register(name, factory)
    register("precise_prefix", PrecisePrefix)
    register("lora_affinity", LoRAAffinity)
