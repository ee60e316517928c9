"""Hot reload: a new config applies to new requests; in-flight ones finish where they started.

Deployments whose model, name and settings are unchanged are carried over as they are (an
engine is not restarted); new ones are started before the switch; removed ones are stopped once
their last in-flight request has closed. A discovery group is one deployment here: carried over
with its members, or, when removed or changed, it stops resolving and its members are retired.
A config that does not load is refused, with its reasons logged and returned, and the old one
keeps serving.
"""

from __future__ import annotations

import asyncio
import logging

from gateway.config import ConfigError, load_config
from gateway.keys.store import KeyStore
from gateway.pools.registry import Deployment, ModelRegistry
from gateway.state import GatewayState

log = logging.getLogger("kvgate.reload")

RETIRE_POLL_S = 0.1


async def reload_config(state: GatewayState) -> tuple[bool, str]:
    """Reload `state.config_path` into `state`. Returns (applied, message)."""
    async with state.reload_lock:
        try:
            config = load_config(state.config_path)
            problems: list[str] = []
            keys = KeyStore.of(config, problems)  # a bad keys-file entry is left out, not a refusal
            reuse = state.registry.reusable()
            registry = ModelRegistry.build(config, state.backends, state.policies, reuse=reuse)
        except (ConfigError, ValueError) as exc:
            message = f"config reload refused, the old config keeps serving: {exc}"
            log.error("%s", message)
            return False, message
        await registry.start()
        old = state.registry
        state.config, state.registry, state.keys, state.key_problems = config, registry, keys, problems
        await old.close_kv_feeds()  # the new pools' policies follow the engines' KV events anew
        for problem in problems:
            log.error("keys file: %s; that entry is no key until it is fixed", problem)
        kept = set(registry.deployments())
        retired = [d for d in old.deployments() if d not in kept]
        for d in retired:
            asyncio.get_running_loop().create_task(_retire(d))
        kept_groups = set(registry.groups())
        for g in old.groups():
            if g not in kept_groups:
                await g.stop_discovery()
        message = (f"config reloaded from {state.config_path}: {len(registry.pools)} models, "
                   f"{len(kept)} deployments, {len(retired)} retiring"
                   + "".join(f"; left out {p}" for p in problems))
        log.info("%s", message)
        return True, message


async def _retire(d: Deployment) -> None:
    while d.in_flight:
        await asyncio.sleep(RETIRE_POLL_S)
    await d.stop()
    log.info("retired deployment %s of model %s stopped", d.name, d.model)
