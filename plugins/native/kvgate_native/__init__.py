"""kvgate-native: the native engine as a backend plugin (kind `native`)."""

from __future__ import annotations

from gateway.hookspecs import hookimpl
from kvgate_native.backend import make_native_backend
from kvgate_native.engine_cli import EngineCommand
from kvgate_native.plan_cli import PlanCommand
from kvgate_native.quantize_cli import QuantizeCommand


@hookimpl
def register_backends(register, config):
    register("native", make_native_backend)


@hookimpl
def register_commands(register):
    register("plan", PlanCommand)
    register("quantize", QuantizeCommand)
    register("engine", EngineCommand)
