"""The Starlette application: routes, error rendering, start-up and shutdown of backends."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
import time
from dataclasses import dataclass, field

import pluggy
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.responses import JSONResponse, RedirectResponse, Response
from starlette.routing import Route

import gateway
from gateway import api, login, token_api
from gateway.asgi import AnthropicErrors, BodyLimitMiddleware
from gateway.auth import AuthMiddleware, KeyLimiter, KeyStore
from gateway.config import GatewayConfig
from gateway.errors import APIError, InvalidRequestError, MethodNotAllowed, NotFoundError
from gateway.hot_routes import HotRoutes
from gateway.key_watch import watch_keys_file
from gateway.limits_store import make_limiter
from gateway.sessions import SessionBook
from gateway.metrics import GatewayMetrics
from gateway.models import ModelRegistry
from gateway.openapi import openapi_json
from gateway.plugins import Registry, collect_backends, collect_routing_policies, make_plugin_manager
from gateway.reload import reload_config
from gateway.status import RecentActivity, status_json, status_page
from gateway.tracing import make_tracer_provider

log = logging.getLogger("kvgate.app")

STREAM_FAREWELL_S = 3.0


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
    metrics: GatewayMetrics = None  # set by build_state
    limiter: KeyLimiter = field(default_factory=KeyLimiter)  # or a RedisLimiter (auth.limits_store)
    recent: RecentActivity = field(default_factory=RecentActivity)
    streams: set = field(default_factory=set)  # tasks serving SSE streams right now
    started_at: float = field(default_factory=time.time)
    reload_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    sessions: SessionBook = field(default_factory=SessionBook)  # status-page sign-outs and failed sign-ins
    key_problems: list = field(default_factory=list)  # keys-file entries left out at the last keys reload


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
    return state


async def health_live(request: Request) -> JSONResponse:
    """200 while the process can serve or recover; 503 once a deployment says it never will
    (an engine in a crash loop), so that Kubernetes restarts the pod."""
    registry = request.app.state.kvgate.registry
    fatal = {d.name: load.problem or "failed" for d in registry.deployments()
             if d.started and (load := d.backend.load()).fatal}
    if fatal:
        return JSONResponse({"status": "failed", "deployments": fatal}, status_code=503)
    return JSONResponse({"status": "alive"})


def _readiness(d) -> str:
    """One deployment's line in the readiness body. Readiness itself counts deployments that are
    up: an open breaker (a backend that failed lately) steers requests elsewhere but does not take
    the gateway out of its Service; it is named here. An engine restart closes it."""
    if d.available:
        return "ready"
    load = d.backend.load()
    if d.started and load.healthy:
        return f"up, breaker {d.breaker.state}"
    return d.start_error or load.problem or "not ready"


async def health_ready(request: Request) -> JSONResponse:
    state = request.app.state.kvgate
    registry = state.registry
    deployments = {d.name: _readiness(d) for d in registry.deployments()}
    for group in registry.groups():  # members not routable yet, and a group with none
        deployments.update(group.readiness())
    ready = registry.ready(state.config.server.readiness)
    return JSONResponse(
        {"status": "ready" if ready else "not ready", "deployments": deployments},
        status_code=200 if ready else 503,
    )


async def health(request: Request) -> JSONResponse:
    """vLLM's and SGLang's `GET /health`, which benchmark clients (GuideLLM, `vllm bench serve`)
    probe before any load: 200 when every model has a deployment up, so that any request for a
    listed model can be served now; 503 naming the models that cannot be."""
    down = request.app.state.kvgate.registry.unservable()
    if down:
        return JSONResponse({"status": "unavailable", "models_down": down}, status_code=503)
    return JSONResponse({"status": "ok"})


async def version(request: Request) -> JSONResponse:
    """vLLM's `GET /version`: this gateway's version."""
    return JSONResponse({"version": gateway.__version__})


async def metrics(request: Request) -> Response:
    return Response(request.app.state.kvgate.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)


async def admin_reload(request: Request) -> JSONResponse:
    state = request.app.state.kvgate
    if state.config_path is None:
        raise APIError("This gateway was not started from a config file.")
    applied, message = await reload_config(state)
    if not applied:
        raise InvalidRequestError(message, code="invalid_config")
    return JSONResponse({"reloaded": True, "message": message})


async def admin_reset_prefix_cache(request: Request) -> JSONResponse:
    """vLLM's POST /reset_prefix_cache for the deployments of `?model=` (default: every model)
    whose backend has a prefix cache to reset (native): each engine forgets its cached prefixes
    and tells its KV-event subscribers (AllBlocksCleared), so precise_prefix's index drops them."""
    registry = request.app.state.kvgate.registry
    model = request.query_params.get("model")
    pools = [registry.resolve(model)] if model is not None else registry.pools
    answer: dict[str, list[str]] = {"reset": [], "unavailable": [], "not_supported": []}
    for d in (d for pool in pools for d in pool.deployments):
        reset = getattr(d.backend, "reset_prefix_cache", None)
        if reset is None:
            answer["not_supported"].append(d.name)
            continue
        try:
            await reset()
        except APIError:
            answer["unavailable"].append(d.name)
        else:
            answer["reset"].append(d.name)
    return JSONResponse(answer)


async def _api_error(request: Request, exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    if exc.status_code == 405:
        err: APIError = MethodNotAllowed(f"Method {request.method} is not allowed on {request.url.path}.")
    elif exc.status_code == 404:
        err = NotFoundError(f"No route {request.method} {request.url.path}.")
    else:
        err = APIError(str(exc.detail))
        err.status = exc.status_code
    return await _api_error(request, err)


async def _unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return await _api_error(request, APIError("The server had an error while processing the request."))


ROUTES = [
    Route("/v1/models", api.list_models, methods=["GET"]),
    Route("/v1/completions", api.completions, methods=["POST"]),
    Route("/v1/chat/completions", api.chat_completions, methods=["POST"]),
    Route("/health", health, methods=["GET"]),
    Route("/version", version, methods=["GET"]),
    Route("/v1/responses", api.responses, methods=["POST"]),
    Route("/v1/messages", api.messages, methods=["POST"]),
    Route("/v1/embeddings", token_api.embeddings, methods=["POST"]),
    Route("/tokenize", token_api.tokenize, methods=["POST"]),
    Route("/v1/messages/count_tokens", token_api.count_message_tokens, methods=["POST"]),
    Route("/detokenize", token_api.detokenize, methods=["POST"]),
    Route("/health/live", health_live, methods=["GET"]),
    Route("/health/ready", health_ready, methods=["GET"]),
    Route("/admin/reload", admin_reload, methods=["POST"]),
    Route("/admin/reset_prefix_cache", admin_reset_prefix_cache, methods=["POST"]),
    Route("/metrics", metrics, methods=["GET"]),
    Route("/openapi.json", openapi_json, methods=["GET"]),
    Route("/", lambda request: RedirectResponse("/status"), methods=["GET"]),
    Route("/status", status_page, methods=["GET"]),
    Route("/status.json", status_json, methods=["GET"]),
    Route("/status/login", login.status_login, methods=["POST"]),
    Route("/status/logout", login.status_logout, methods=["POST"]),
]


def create_app(state: GatewayState):
    """The ASGI app for a built state; backends start in the lifespan, stop at shutdown."""

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await state.registry.start()
        await state.limiter.start()
        _reload_on_sighup(state)
        watcher = asyncio.get_running_loop().create_task(watch_keys_file(state))
        try:
            yield
        finally:
            watcher.cancel()
            if state.streams:  # streams cut by the shutdown timeout: let them send their last event
                await asyncio.wait(set(state.streams), timeout=STREAM_FAREWELL_S)
            await state.registry.stop()
            await state.limiter.stop()
            if state.tracer_provider is not None:
                state.tracer_provider.shutdown()  # flushes spans still in the batch queue

    app = Starlette(
        routes=ROUTES,
        lifespan=lifespan,
        exception_handlers={APIError: _api_error, HTTPException: _http_error, Exception: _unexpected_error},
    )
    app.state.kvgate = state
    app = HotRoutes(app, {"/v1/completions": api.completions, "/v1/chat/completions": api.chat_completions})
    app = AuthMiddleware(app, keys_of=lambda: state.keys, sessions=state.sessions)
    app = BodyLimitMiddleware(app, max_bytes=state.config.server.limits.max_body_bytes)
    return AnthropicErrors(app, paths=frozenset({"/v1/messages", "/v1/messages/count_tokens"}))


def _reload_on_sighup(state: GatewayState) -> None:
    if state.config_path is None or threading.current_thread() is not threading.main_thread():
        return
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGHUP, lambda: loop.create_task(reload_config(state)))
