"""The Starlette application: routes, error rendering, start-up and shutdown of backends."""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field

import pluggy
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from gateway import api
from gateway.asgi import BodyLimitMiddleware
from gateway.config import GatewayConfig
from gateway.errors import APIError, MethodNotAllowed, NotFoundError
from gateway.models import ModelRegistry
from gateway.plugins import collect_backends, collect_routing_policies, make_plugin_manager

log = logging.getLogger("kvgate.app")


@dataclass
class GatewayState:
    config: GatewayConfig
    pm: pluggy.PluginManager
    registry: ModelRegistry
    started_at: float = field(default_factory=time.time)


def build_state(config: GatewayConfig, pm: pluggy.PluginManager | None = None) -> GatewayState:
    """Load plugins and create (not start) every backend. Raises ValueError on bad settings."""
    pm = pm or make_plugin_manager()
    backends = collect_backends(pm, config.plugins)
    policies = collect_routing_policies(pm)
    return GatewayState(config, pm, ModelRegistry.build(config, backends, policies))


async def health_live(request: Request) -> JSONResponse:
    return JSONResponse({"status": "alive"})


async def health_ready(request: Request) -> JSONResponse:
    registry = request.app.state.kvgate.registry
    deployments = {
        d.name: ("ready" if d.available else (d.start_error or "not ready"))
        for d in registry.deployments()
    }
    ready = registry.ready
    return JSONResponse(
        {"status": "ready" if ready else "not ready", "deployments": deployments},
        status_code=200 if ready else 503,
    )


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
    Route("/health/live", health_live, methods=["GET"]),
    Route("/health/ready", health_ready, methods=["GET"]),
]


def create_app(state: GatewayState):
    """The ASGI app for a built state; backends start in the lifespan, stop at shutdown."""

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await state.registry.start()
        try:
            yield
        finally:
            await state.registry.stop()

    app = Starlette(
        routes=ROUTES,
        lifespan=lifespan,
        exception_handlers={APIError: _api_error, HTTPException: _http_error, Exception: _unexpected_error},
    )
    app.state.kvgate = state
    return BodyLimitMiddleware(app, max_bytes=state.config.server.limits.max_body_bytes)
