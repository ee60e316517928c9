"""vLLM's runtime LoRA endpoints, admin scope: POST /v1/load_lora_adapter {"lora_name", "lora_path"}
loads an adapter onto every deployment of a model that serves adapters (all or none: a refusal
unloads it from those that took it), POST /v1/unload_lora_adapter {"lora_name"} unloads it. The
answers are vLLM's: 200 with the text "Success: LoRA adapter '<name>' added successfully.", an
OpenAI-style error otherwise. The model is `base_model_name` in the body (vLLM's --lora-modules
JSON form) or `?model=`, needed only where several models serve adapters."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import PlainTextResponse

from gateway.errors import APIError, InvalidRequestError, NotFoundError
from gateway.protocol.json_body import parse_body
from gateway.state import state_of


async def load_lora_adapter(request: Request) -> PlainTextResponse:
    body = await _body(request)
    name, path = body.get("lora_name"), body.get("lora_path")
    if not (_text(name) and _text(path)):
        raise InvalidRequestError("Both 'lora_name' and 'lora_path' must be provided.",
                                  param="lora_name" if not _text(name) else "lora_path")
    registry = state_of(request).registry
    _check_new_name(registry, name)
    pool = _pool_for(registry, body.get("base_model_name") or request.query_params.get("model"))
    deployments = _serving(pool)
    loaded = []
    try:
        for d in deployments:
            await d.backend.load_lora_adapter(name, path)
            loaded.append(d)
    except APIError:
        for d in loaded:  # all or none: a request for it may go to any deployment of the model
            await _unload_quietly(d, name)
        raise
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(request: Request) -> PlainTextResponse:
    body = await _body(request)
    name = body.get("lora_name")
    if not _text(name):
        raise InvalidRequestError("'lora_name' must be provided.", param="lora_name")
    holders = [d for pool in state_of(request).registry.pools for d in _serving(pool, needed=False)
               if d.holds_adapter(name)]
    if not holders:
        raise NotFoundError(f"The lora adapter '{name}' cannot be found.", param="lora_name")
    for d in holders:
        await d.backend.unload_lora_adapter(name)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


async def _body(request: Request) -> dict:
    limits = state_of(request).config.server.limits
    body = parse_body(await request.body(), limits.max_json_depth)
    if not isinstance(body, dict):
        raise InvalidRequestError("The body must be a JSON object.")
    return body


def _text(value) -> bool:
    return isinstance(value, str) and bool(value)


def _check_new_name(registry, name: str) -> None:
    """vLLM refuses a name already loaded; here a model's name or alias is taken too (it would
    shadow the adapter: `model` names the model first)."""
    if registry.get(name) is not None:
        raise InvalidRequestError(f"'{name}' is the name of a model of this gateway.", param="lora_name")
    if any(name in pool.adapters() for pool in registry.pools):
        raise InvalidRequestError(f"The lora adapter '{name}' has already been loaded.", param="lora_name")


def _pool_for(registry, model: str | None):
    """The model named, or the only one with deployments that serve adapters."""
    if model is not None:
        return registry.resolve(model)
    pools = [p for p in registry.pools if _serving(p, needed=False)]
    if len(pools) == 1:
        return pools[0]
    if not pools:
        raise InvalidRequestError("No model of this gateway serves LoRA adapters (enable_lora on a native "
                                  "deployment).", param="lora_name")
    names = ", ".join(p.name for p in pools)
    raise InvalidRequestError(f"Several models serve LoRA adapters ({names}): name one as 'base_model_name'.",
                              param="base_model_name")


def _serving(pool, needed: bool = True) -> list:
    """The started deployments of `pool` that load adapters; with `needed`, a 400 when none does."""
    found = [d for d in pool.deployments if d.started and d.backend.load_lora_adapter is not None
             and d.backend.load().lora is not None]
    if needed and not found:
        raise InvalidRequestError(f"No running deployment of model '{pool.name}' serves LoRA adapters.",
                                  param="base_model_name")
    return found


async def _unload_quietly(d, name: str) -> None:
    try:
        await d.backend.unload_lora_adapter(name)
    except APIError:
        pass  # it stays loaded there; an operator's unload names it again
