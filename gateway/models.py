"""Models, their pools of deployments, and the backends behind them."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from gateway.backend import Backend
from gateway.config import GatewayConfig, ModelConfig
from gateway.errors import ModelNotFound, Overloaded
from gateway.plugins import Registry

log = logging.getLogger("kvgate.models")


@dataclass
class Deployment:
    """One backend instance serving one model."""

    name: str
    model: str
    upstream_model: str
    weight: float
    backend: Backend
    started: bool = False
    start_error: str | None = None

    @property
    def available(self) -> bool:
        return self.started and self.backend.load().healthy


@dataclass
class ModelPool:
    name: str
    aliases: list[str]
    deployments: list[Deployment]
    policy: object = field(repr=False)

    def choose(self, request) -> Deployment:
        candidates = [d for d in self.deployments if d.available]
        if not candidates:
            raise Overloaded(
                f"No backend of model '{self.name}' is available right now.", retry_after_s=5
            )
        return self.policy.choose(request, candidates)


class ModelRegistry:
    def __init__(self, pools: list[ModelPool]):
        self.pools = pools
        self._by_name = {n: p for p in pools for n in [p.name, *p.aliases]}

    @classmethod
    def build(cls, config: GatewayConfig, backends: Registry, policies: Registry) -> "ModelRegistry":
        """Create (not start) every deployment's backend; bad settings raise ValueError with a path."""
        pools = [_build_pool(i, m, backends, policies) for i, m in enumerate(config.models)]
        return cls(pools)

    def resolve(self, name: str) -> ModelPool:
        try:
            return self._by_name[name]
        except KeyError:
            raise ModelNotFound(name) from None

    def deployments(self) -> list[Deployment]:
        return [d for p in self.pools for d in p.deployments]

    @property
    def ready(self) -> bool:
        return all(d.available for d in self.deployments())

    async def start(self) -> None:
        """Start every backend concurrently. A backend that fails to start is logged and stays
        out of rotation (readiness stays false); the others serve."""
        await asyncio.gather(*(_start(d) for d in self.deployments()))

    async def stop(self) -> None:
        await asyncio.gather(*(_stop(d) for d in self.deployments() if d.started))


def _build_pool(index: int, model: ModelConfig, backends: Registry, policies: Registry) -> ModelPool:
    deployments = []
    for j, d in enumerate(model.deployments):
        where = f"models[{index}].deployments[{j}]"
        try:
            factory = backends.get(d.backend)
        except KeyError as exc:
            raise ValueError(f"{where}.backend: {exc.args[0]}") from None
        try:
            backend = factory(dict(d.settings), d.name)
        except ValueError as exc:
            raise ValueError(f"{where}.{exc}") from None
        deployments.append(
            Deployment(d.name, model.name, d.upstream_model or model.name, d.weight, backend)
        )
    policy = policies.get("round_robin")({})
    return ModelPool(model.name, list(model.aliases), deployments, policy)


async def _start(d: Deployment) -> None:
    try:
        await d.backend.start()
        d.started = True
        log.info("deployment %s of model %s started", d.name, d.model)
    except Exception as exc:  # noqa: BLE001 - one bad backend must not stop the others
        d.start_error = str(exc) or type(exc).__name__
        log.error("deployment %s of model %s failed to start: %s", d.name, d.model, d.start_error)


async def _stop(d: Deployment) -> None:
    try:
        await d.backend.stop()
    except Exception:  # noqa: BLE001
        log.exception("deployment %s failed to stop cleanly", d.name)
    d.started = False
