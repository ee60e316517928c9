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
from starlette.responses import JSONResponse, RedirectResponse
from starlette.routing import Route

from gateway.api import generate as api
from gateway.api import ops
from gateway.api import tokens as token_api
from gateway.api.openapi import openapi_json
from gateway.api.status import status_json, status_page
from gateway.errors import APIError, MethodNotAllowed, NotFoundError
from gateway.http import login
from gateway.http.asgi import AnthropicErrors, BodyLimitMiddleware
from gateway.http.auth import AuthMiddleware
from gateway.http.hot_routes import HotRoutes
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


ROUTES = [
    Route("/v1/models", api.list_models, methods=["GET"]),
    Route("/key/info", api.key_info, methods=["GET"]),
    Route("/v1/completions", api.completions, methods=["POST"]),
    Route("/v1/chat/completions", api.chat_completions, methods=["POST"]),
    Route("/health", ops.health, methods=["GET"]),
    Route("/version", ops.version, methods=["GET"]),
    Route("/v1/responses", api.responses, methods=["POST"]),
    Route("/v1/messages", api.messages, methods=["POST"]),
    Route("/v1/embeddings", token_api.embeddings, methods=["POST"]),
    Route("/tokenize", token_api.tokenize, methods=["POST"]),
    Route("/v1/messages/count_tokens", token_api.count_message_tokens, methods=["POST"]),
    Route("/detokenize", token_api.detokenize, methods=["POST"]),
    Route("/health/live", ops.health_live, methods=["GET"]),
    Route("/health/ready", ops.health_ready, methods=["GET"]),
    Route("/admin/reload", ops.admin_reload, methods=["POST"]),
    Route("/admin/reset_prefix_cache", ops.admin_reset_prefix_cache, methods=["POST"]),
    Route("/metrics", ops.metrics, methods=["GET"]),
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
