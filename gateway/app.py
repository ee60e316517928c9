"""The Starlette application: routes, error rendering, start-up and shutdown of backends."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse

from gateway.api import routes
from gateway.errors import APIError, MethodNotAllowed, NotFoundError
from gateway.http.asgi import AnthropicErrors, BodyLimitMiddleware
from gateway.http.auth import AuthMiddleware
from gateway.http.hot_routes import HotRoutes
from gateway.http.routes import access_by_path, hot_handlers, paths_erring_in, starlette_routes
from gateway.lifecycle.keys_file import watch_keys_file
from gateway.lifecycle.reload import reload_config
from gateway.state import GatewayState

log = logging.getLogger("kvgate.app")

STREAM_FAREWELL_S = 3.0


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




def create_app(state: GatewayState):
    """The ASGI app for a built state; backends start in the lifespan, stop at shutdown. Its
    router, auth rules, hot routes and Anthropic-error paths all come from one table,
    gateway/api/routes.py (read when the app is built)."""
    endpoints = routes.ENDPOINTS

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await state.registry.start()
        await state.limiter.start()
        if state.budgets is not None:
            await state.budgets.start()
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
            if state.budgets is not None:
                await state.budgets.stop()
            for cache in state.caches.values():
                await cache.store.stop()
            if state.tracer_provider is not None:
                state.tracer_provider.shutdown()  # flushes spans still in the batch queue

    app = Starlette(
        routes=starlette_routes(endpoints),
        lifespan=lifespan,
        exception_handlers={APIError: _api_error, HTTPException: _http_error, Exception: _unexpected_error},
    )
    app.state.kvgate = state
    app = HotRoutes(app, hot_handlers(endpoints))
    app = AuthMiddleware(app, keys_of=lambda: state.keys, sessions=state.sessions, access=access_by_path(endpoints))
    app = BodyLimitMiddleware(app, max_bytes=state.config.server.limits.max_body_bytes)
    return AnthropicErrors(app, paths=paths_erring_in(endpoints, "anthropic"))


def _reload_on_sighup(state: GatewayState) -> None:
    if state.config_path is None or threading.current_thread() is not threading.main_thread():
        return
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGHUP, lambda: loop.create_task(reload_config(state)))
