"""The gateway's shared state, typed: what serving needs, built once from the config.

Every part that reads it (endpoints, the status page, reloads, a request's recorder) imports
`GatewayState` from here; `request.app.state.kvgate` is this object.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import pluggy
from starlette.requests import Request

from gateway.budgets.ledger import Budgets, make_budgets
from gateway.cache.responses import ResponseCache, make_caches
from gateway.config import GatewayConfig
from gateway.keys.limits import KeyLimiter
from gateway.keys.redis_limiter import RedisLimiter, make_limiter
from gateway.keys.sessions import SessionBook
from gateway.keys.store import KeyStore
from gateway.observability.metrics import GatewayMetrics
from gateway.observability.recent import RecentActivity
from gateway.observability.tracing import make_tracer_provider
from gateway.plugins import Registry, collect_backends, collect_routing_policies, make_plugin_manager
from gateway.pools.registry import ModelRegistry


@dataclass
class GatewayState:
    """What serving needs. A reload swaps `config`, `registry` and `keys` together; a request
    reads them once at its start and keeps its references to the end."""

    config: GatewayConfig
    pm: pluggy.PluginManager
    registry: ModelRegistry
    keys: KeyStore
    backends: Registry
    policies: Registry
    config_path: str | None = None
    tracer_provider: object = None  # this gateway's OpenTelemetry TracerProvider, when tracing
    tracer: object = None  # an OpenTelemetry tracer, or None when tracing is off
    metrics: GatewayMetrics = field(init=False)  # set by build_state: it reads this state at scrape time
    budgets: Budgets | None = None  # None: no budgets configured (nothing is reserved or settled)
    caches: dict[str, ResponseCache] = field(default_factory=dict)  # model -> its response cache, if it has one
    limiter: KeyLimiter | RedisLimiter = field(default_factory=KeyLimiter)  # RedisLimiter: auth.limits_store
    recent: RecentActivity = field(default_factory=RecentActivity)
    streams: set[asyncio.Task] = field(default_factory=set)  # tasks serving SSE streams right now
    started_at: float = field(default_factory=time.time)
    reload_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    sessions: SessionBook = field(default_factory=SessionBook)  # status-page sign-outs and failed sign-ins
    key_problems: list[str] = field(default_factory=list)  # keys-file entries left out at the last keys reload


def build_state(config: GatewayConfig, pm: pluggy.PluginManager | None = None,
                config_path: str | None = None, span_exporter=None) -> GatewayState:
    """Load plugins and create (not start) every backend. Raises ValueError on bad settings."""
    pm = pm or make_plugin_manager()
    backends = collect_backends(pm, config.plugins)
    policies = collect_routing_policies(pm)
    keys = KeyStore.of(config)
    limiter = make_limiter(config.auth.limits_store)
    registry = ModelRegistry.build(config, backends, policies)
    provider = make_tracer_provider(config.telemetry.tracing, span_exporter)
    state = GatewayState(config, pm, registry, keys, backends, policies, config_path, tracer_provider=provider,
                         limiter=limiter, tracer=provider.get_tracer("kvgate.gateway") if provider else None)
    state.metrics = GatewayMetrics(lambda: state)
    state.caches = make_caches(config, state.metrics.cache_requests)
    if config.budgets.limits:
        state.budgets = make_budgets(config)
        state.metrics.registry.register(state.budgets)
    return state


def state_of(request: Request) -> GatewayState:
    """The state serving this request (the app's, set by gateway.app.create_app)."""
    return request.app.state.kvgate
