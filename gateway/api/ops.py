"""The operator's endpoints: health and readiness probes, version, metrics, admin actions."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

import gateway
from gateway.errors import APIError, InvalidRequestError
from gateway.lifecycle.reload import reload_config
from gateway.state import state_of


async def health_live(request: Request) -> JSONResponse:
    """200 while the process can serve or recover; 503 once a deployment says it never will
    (an engine in a crash loop), so that Kubernetes restarts the pod."""
    registry = state_of(request).registry
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
    state = state_of(request)
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
    down = state_of(request).registry.unservable()
    if down:
        return JSONResponse({"status": "unavailable", "models_down": down}, status_code=503)
    return JSONResponse({"status": "ok"})


async def version(request: Request) -> JSONResponse:
    """vLLM's `GET /version`: this gateway's version."""
    return JSONResponse({"version": gateway.__version__})


async def metrics(request: Request) -> Response:
    return Response(state_of(request).metrics.exposition(), media_type=CONTENT_TYPE_LATEST)


async def admin_reload(request: Request) -> JSONResponse:
    state = state_of(request)
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
    registry = state_of(request).registry
    model = request.query_params.get("model")
    pools = [registry.resolve(model)] if model is not None else registry.pools
    answer: dict[str, list[str]] = {"reset": [], "unavailable": [], "not_supported": []}
    for d in (d for pool in pools for d in pool.deployments):
        reset = d.backend.reset_prefix_cache
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
