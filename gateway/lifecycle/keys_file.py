"""The keys file, watched: when it changes, the keys are replaced on their own.

A Kubernetes Secret mounted as a volume is updated in place (the kubelet swaps it within about a
minute); keys given as environment variables are fixed for the life of the process and change
only with a rollout. So `auth.keys_file_env` is where keys that come and go belong: every
`auth.keys_file_poll_s` the file's content is compared with the last one read, and a change
reloads the keys alone (the config and the deployments are untouched). A bad entry is logged,
shown on the status page and left out (it is no key until fixed); the valid ones, and the
removal of a revoked key, apply at once. A file that cannot be read at all keeps the old keys.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging

from gateway.keys.store import KeyStore, keys_file_path
from gateway.state import GatewayState

log = logging.getLogger("kvgate.auth")


def reload_keys(state: GatewayState) -> bool:
    """Replace `state.keys` from the config and the keys file as they are now. Returns whether
    the keys were replaced; what was wrong is in `state.key_problems`."""
    problems: list[str] = []
    try:
        keys = KeyStore.of(state.config, problems)
    except ValueError as exc:
        state.key_problems = [f"{exc}; the previous keys stay in use"]
        log.error("keys not reloaded: %s", state.key_problems[0])
        return False
    state.keys, state.key_problems = keys, problems
    for problem in problems:
        log.error("keys file: %s; that entry is no key until it is fixed", problem)
    log.info("keys reloaded: %d keys%s", len(keys.keys), f", {len(problems)} entries left out" if problems else "")
    return True


async def watch_keys_file(state: GatewayState) -> None:
    """Reload the keys whenever the keys file's content changes (until cancelled)."""
    last = _fingerprint(state)
    while True:
        await asyncio.sleep(state.config.auth.keys_file_poll_s)
        now = _fingerprint(state)
        if now != last:
            last = now
            reload_keys(state)


def _fingerprint(state: GatewayState) -> str | None:
    env_name = state.config.auth.keys_file_env
    if env_name is None:
        return None
    try:
        with open(keys_file_path(env_name), "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except (OSError, ValueError):
        return None
