"""Models, their pools of deployments, and the backends behind them."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from gateway.backend import Backend
from gateway.capabilities import DEFAULT_CAPABILITIES, Capabilities, Needs, capabilities_of, unservable
from gateway.config import DeploymentConfig, GatewayConfig, ModelConfig, RequestLimits, SaturationConfig
from gateway.errors import ModelNotFound
from gateway.plugins import Registry
from gateway.policy import RoutingPolicy
from gateway.pools.admission import PoolAdmission
from gateway.pools.breaker import CircuitBreaker
from gateway.pools.discovery import DiscoveryGroup

log = logging.getLogger("kvgate.models")


@dataclass(eq=False)
class Deployment:
    """One backend instance serving one model, with what the gateway tracks about it."""

    name: str
    model: str
    upstream_model: str
    weight: float
    backend: Backend
    breaker: CircuitBreaker
    config: DeploymentConfig | None = None
    started: bool = False
    start_error: str | None = None
    in_flight: int = 0  # requests the gateway has sent and not yet closed
    capabilities: Capabilities = DEFAULT_CAPABILITIES  # what it declared when it was built

    @property
    def role(self) -> str:
        """colocated, prefill or decode (DeploymentConfig.role)."""
        return self.config.role if self.config is not None else "colocated"

    @property
    def available(self) -> bool:
        """Started, healthy and not taken out by its breaker (it may still be busy)."""
        return self.started and self.breaker.allows() and self.backend.load().healthy

    def saturated(self, limits: SaturationConfig, max_in_flight: int) -> bool:
        if max_in_flight and self.in_flight >= max_in_flight:
            return True
        load = self.backend.load()
        if load.waiting >= limits.max_waiting or load.kv_cache_usage >= limits.max_kv_cache_usage:
            return True
        return bool(load.capacity) and load.running + load.waiting >= load.capacity + limits.max_waiting

    def holds_adapter(self, name: str) -> bool:
        """Whether it runs LoRA adapter `name` now (its load's LoRAState)."""
        lora = self.backend.load().lora if self.started else None
        return lora is not None and name in lora.adapters

    async def stop(self) -> None:
        """Stop the backend; a failure is logged, never raised (the others must stop too)."""
        try:
            await self.backend.stop()
        except Exception:  # noqa: BLE001
            log.exception("deployment %s failed to stop cleanly", self.name)
        self.started = False


@dataclass(eq=False)
class ModelPool:
    name: str
    aliases: list[str]
    deployments: list[Deployment]
    policy: RoutingPolicy = field(repr=False)
    config: ModelConfig = field(repr=False)
    groups: list[DiscoveryGroup] = field(default_factory=list, repr=False)  # deployments found in DNS
    # A disaggregated model's prefill hops are chosen by a policy instance of their own: one shared
    # with the decode hops would hand its turns (and its memory of choices) alternately to each.
    prefill_policy: RoutingPolicy | None = field(default=None, repr=False)
    admission: PoolAdmission = field(init=False, repr=False)

    def __post_init__(self):
        self.admission = PoolAdmission(self, self.config.queue.max_size)
        self.static = list(self.deployments)
        self.deployments = self.static + [m for g in self.groups for m in g.members()]

    def refresh_members(self) -> None:
        """A discovery group's routable members changed: route over the new list from now on
        (a request that already holds a member keeps it), and let queued requests try them."""
        self.deployments = self.static + [m for g in self.groups for m in g.members()]
        self.follow_kv_events()
        self.admission.wake()

    def follow_kv_events(self) -> None:
        """A policy that indexes KV events (precise_prefix) follows the deployments routed over
        now, and forgets those that left (discovery, drain, reload)."""
        for feed in self.kv_feeds():
            feed.retain(self.deployments)
            feed.track([d for d in self.deployments if d.started])

    def kv_feeds(self) -> list:
        """The KV-event feeds of its policies, each once (precise_prefix has one; a disaggregated
        model's prefill policy shares it: one subscription per engine)."""
        feeds = [p.kv_feed for p in (self.policy, self.prefill_policy) if p is not None and p.kv_feed is not None]
        return list({id(f): f for f in feeds}.values())

    async def prepare_routing(self, request) -> None:
        """What the policy computes before it can choose, outside the synchronous `take`
        (precise_prefix: the prompt's token ids, on threads or from a backend's /tokenize). Its
        prefill policy, where it has one, shares what this prepares."""
        await self.policy.prepare(request, self.deployments)

    def take(self, request, exclude: frozenset[str] = frozenset(), role: str = "decode") -> Deployment | None:
        """Choose a deployment that can take `request` now (and serves what it needs) and claim a
        slot on it, or None. Requests go to colocated and decode deployments; prefill ones only
        take the prefill hop of a disaggregated request (role "prefill", gateway.dispatch.disagg)."""
        needs = request.needs
        roles = ("prefill",) if role == "prefill" else ("colocated", "decode")
        candidates = [
            d for d in self.deployments
            if d.name not in exclude and d.role in roles and d.capabilities.serves(needs) and d.available
            and (needs.adapter is None or d.holds_adapter(needs.adapter))
            and not d.saturated(self.config.saturation, self.config.queue.max_in_flight_per_deployment)
        ]
        if not candidates:
            return None
        policy = self.prefill_policy if role == "prefill" and self.prefill_policy is not None else self.policy
        chosen = policy.choose(request, candidates)
        chosen.in_flight += 1
        chosen.breaker.claim()
        return chosen

    def adapters(self) -> dict[str, str]:
        """The LoRA adapters its started deployments hold: name -> directory (the first's)."""
        found: dict[str, str] = {}
        for d in self.deployments:
            lora = d.backend.load().lora if d.started else None
            for name, root in (lora.adapters if lora is not None else {}).items():
                found.setdefault(name, root)
        return found

    def any_available(self, needs: Needs | None = None) -> bool:
        """Whether a deployment that serves requests (not a prefill one) is up for `needs`."""
        return any(d.available for d in self.deployments
                   if d.role != "prefill" and (needs is None or d.capabilities.serves(needs))
                   and (needs is None or needs.adapter is None or d.holds_adapter(needs.adapter)))

    def declared(self) -> list[tuple[str, Capabilities]]:
        """(name, capabilities) of every deployment as configured: a discovery group counts once,
        with what its members declare, whether or not any is up now."""
        return [(d.name, d.capabilities) for d in self.static] + [(g.config.name, g.capabilities) for g in self.groups]

    def check_servable(self, needs: Needs) -> None:
        """A 400 naming what the request asks for and the deployments lacking it, when no
        deployment of this model declares everything it needs."""
        error = unservable(self.name, needs, self.declared())
        if error is not None:
            raise error

    def release(self, deployment: Deployment) -> None:
        deployment.in_flight -= 1
        self.admission.wake()

    @property
    def in_flight(self) -> int:
        return sum(d.in_flight for d in self.deployments) + sum(g.draining_in_flight() for g in self.groups)


class ModelRegistry:
    def __init__(self, pools: list[ModelPool]):
        self.pools = pools
        self._by_name = {n: p for p in pools for n in [p.name, *p.aliases]}

    @classmethod
    def build(cls, config: GatewayConfig, backends: Registry, policies: Registry,
              reuse: dict[tuple, Deployment] | None = None) -> "ModelRegistry":
        """Create (not start) every deployment's backend; bad settings raise ValueError with a
        path. Deployments found in `reuse` (same model, name and config) are kept as they are."""
        pools = [_build_pool(i, m, backends, policies, reuse or {}, config.server.limits)
                 for i, m in enumerate(config.models)]
        return cls(pools)

    def resolve(self, name: str) -> ModelPool:
        try:
            return self._by_name[name]
        except KeyError:
            raise ModelNotFound(name) from None

    def get(self, name: str) -> ModelPool | None:
        return self._by_name.get(name)

    def route(self, name: str) -> tuple[ModelPool, str | None]:
        """The pool a request's `model` names, and the LoRA adapter when it names one (an adapter a
        deployment of the pool holds; model names and aliases come first); ModelNotFound if neither."""
        pool = self._by_name.get(name)
        if pool is not None:
            return pool, None
        for pool in self.pools:
            if name in pool.adapters():
                return pool, name
        raise ModelNotFound(name)

    def deployments(self) -> list[Deployment]:
        """Every routable deployment: the listed ones and the discovered members taking requests."""
        return [d for p in self.pools for d in p.deployments]

    def groups(self) -> list[DiscoveryGroup]:
        return [g for p in self.pools for g in p.groups]

    def reusable(self) -> dict[tuple, "Deployment | DiscoveryGroup"]:
        """What a reload may carry over as it is: listed deployments and discovery groups (with
        their members), keyed by model, name and config."""
        kept: dict[tuple, Deployment | DiscoveryGroup] = {}
        for p in self.pools:
            kept.update((deployment_key(p.name, d.config), d) for d in p.static if d.config)
            kept.update((deployment_key(p.name, g.config), g) for g in p.groups)
        return kept

    def ready(self, mode: str = "all") -> bool:
        """Every deployment up ("all"), or at least one per model ("any"). A discovery group
        counts as one deployment, up while one of its members is."""
        if mode == "any":
            return not self.unservable()
        return all(_up(d) for d in self.deployments()) and all(
            any(_up(d) for d in g.members()) for g in self.groups())

    def unservable(self) -> list[str]:
        """The models none of whose deployments that take requests is up (a prefill deployment
        alone serves nothing): no request for them can be served now."""
        return [p.name for p in self.pools if not any(_up(d) for d in p.deployments if d.role != "prefill")]

    async def start(self) -> None:
        """Start every backend not yet started, and every discovery group, concurrently. A
        backend that fails to start is logged and stays out of rotation (readiness stays false);
        the others serve."""
        for p in self.pools:
            for g in p.groups:
                g.attach(p)
        await asyncio.gather(*(_start(d) for p in self.pools for d in p.static if not d.started),
                             *(g.start() for g in self.groups() if not g.running))
        for p in self.pools:
            p.refresh_members()

    async def close_kv_feeds(self) -> None:
        """Stop following KV events (a reload's replaced registry, or shutdown)."""
        await asyncio.gather(*(feed.close() for p in self.pools for feed in p.kv_feeds()))

    async def stop(self) -> None:
        await self.close_kv_feeds()
        await asyncio.gather(*(g.close() for g in self.groups()))
        await asyncio.gather(*(d.stop() for d in self.deployments() if d.started))


def _up(d: Deployment) -> bool:
    return d.started and d.backend.load().healthy


def deployment_key(model: str, d: DeploymentConfig) -> tuple:
    return (model, d.name, d.model_dump_json())


def _build_pool(index: int, model: ModelConfig, backends: Registry, policies: Registry,
                reuse: dict[tuple, Deployment], limits: RequestLimits) -> ModelPool:
    deployments, groups = [], []
    for j, d in enumerate(model.deployments):
        where = f"models[{index}].deployments[{j}]"
        kept = reuse.get(deployment_key(model.name, d))
        if d.discovery is None:
            deployments.append(kept or _build_deployment(where, model, d, backends, limits))
        else:
            groups.append(kept or _build_group(where, model, d, backends, limits))
    try:
        make_policy = policies.get(model.policy)
    except KeyError as exc:
        raise ValueError(f"models[{index}].policy: {exc.args[0]}") from None
    policy = _policy(index, model, make_policy)
    prefill_policy = _prefill_policy(policy, make_policy, model) if model.disaggregated else None
    return ModelPool(model.name, list(model.aliases), deployments, policy, model, groups, prefill_policy)


def _policy(index: int, model: ModelConfig, make_policy) -> RoutingPolicy:
    policy = make_policy(dict(model.policy_options))
    if not isinstance(policy, RoutingPolicy):
        raise ValueError(f"models[{index}].policy: '{model.policy}' made a {type(policy).__name__}, which does not "
                         "subclass gateway.policy.RoutingPolicy")
    return policy


def _prefill_policy(policy, make_policy, model: ModelConfig):
    """The prefill hops' own policy instance: its turns and memory of choices apart, but what it
    may share with the decode hops' (precise_prefix: the KV index and its subscriptions) shared."""
    sibling = policy.sibling()
    return sibling if sibling is not None else make_policy(dict(model.policy_options))


def _build_group(where: str, model: ModelConfig, d: DeploymentConfig, backends: Registry,
                 limits: RequestLimits) -> DiscoveryGroup:
    """A discovery group whose members are `d` with their own name and base_url. One member is
    built now and dropped, so that bad settings are refused at load time (and by check-config)."""

    def make_member(name: str, base_url: str) -> Deployment:
        member = d.model_copy(update={"name": name, "settings": {**d.settings, "base_url": base_url}})
        return _build_deployment(where, model, member, backends, limits)

    group = DiscoveryGroup(model.name, d, make_member)
    try:
        check = make_member(f"{d.name}@check", group.base_url("192.0.2.1"))  # TEST-NET-1: never contacted
        group.capabilities = check.capabilities
    except ValueError as exc:
        if ".settings.base_url:" in str(exc):
            raise ValueError(f"{where}.discovery: backend '{d.backend}' cannot take discovered endpoints "
                             "(it has no settings.base_url); use a backend that does, such as openai") from None
        raise
    return group


def _build_deployment(where: str, model: ModelConfig, d: DeploymentConfig, backends: Registry,
                      limits: RequestLimits) -> Deployment:
    try:
        factory = backends.get(d.backend)
    except KeyError as exc:
        raise ValueError(f"{where}.backend: {exc.args[0]}") from None
    try:
        backend = factory(dict(d.settings), d.name)
    except ValueError as exc:
        raise ValueError(f"{where}.{exc}") from None
    if not isinstance(backend, Backend):
        raise ValueError(f"{where}.backend: kind '{d.backend}' made a {type(backend).__name__}, which does not "
                         "subclass gateway.backend.Backend (the gateway calls its optional members' defaults)")
    backend.use_limits(limits)  # a backend that enforces some of server.limits itself (before start)
    try:
        capabilities = capabilities_of(backend)
    except ValueError as exc:
        raise ValueError(f"{where}.settings.{exc}") from None
    breaker = CircuitBreaker(model.breaker.failures, model.breaker.cooldown_s,
                             incarnation=lambda: backend.load().incarnation)
    return Deployment(d.name, model.name, d.upstream_model or model.name, d.weight, backend, breaker, d,
                      capabilities=capabilities)


async def _start(d: Deployment) -> None:
    try:
        await d.backend.start()
        d.started = True
        d.start_error = None
        log.info("deployment %s of model %s started", d.name, d.model)
    except Exception as exc:  # noqa: BLE001 - one bad backend must not stop the others
        d.start_error = str(exc) or type(exc).__name__
        log.error("deployment %s of model %s failed to start: %s", d.name, d.model, d.start_error)
