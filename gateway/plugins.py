"""Plugin discovery and the tables plugins fill in.

Plugins come from the `kvgate` entry-point group. `KVGATE_PLUGINS` (comma-separated entry-point
names) restricts which ones load; the gateway's own built-in plugin always loads, since routing
needs its policies.
"""

from __future__ import annotations

import logging
import os
from importlib.metadata import entry_points
from typing import Any, Callable

import pluggy

from gateway import hookspecs

log = logging.getLogger("kvgate.plugins")

ENTRY_POINT_GROUP = "kvgate"
ALWAYS_LOADED = {"builtin_policies"}


def enabled_plugin_names() -> set[str] | None:
    """Names from KVGATE_PLUGINS, or None when every discovered plugin may load."""
    raw = os.environ.get("KVGATE_PLUGINS", "").strip()
    if not raw:
        return None
    return {name.strip() for name in raw.split(",") if name.strip()} | ALWAYS_LOADED


def make_plugin_manager(extra_plugins: dict[str, Any] | None = None) -> pluggy.PluginManager:
    """A plugin manager with every enabled entry-point plugin, plus `extra_plugins` (tests)."""
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    enabled = enabled_plugin_names()
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if enabled is not None and ep.name not in enabled:
            continue
        if pm.has_plugin(ep.name):
            continue  # the same distribution seen twice on sys.path
        pm.register(ep.load(), name=ep.name)
        log.debug("loaded plugin %s from %s", ep.name, ep.value)
    for name, plugin in (extra_plugins or {}).items():
        pm.register(plugin, name=name)
    return pm


class Registry:
    """A name -> factory table that refuses duplicates, filled through a `register` callback."""

    def __init__(self, what: str):
        self.what = what
        self.factories: dict[str, Callable] = {}
        self.owners: dict[str, str] = {}

    def register_from(self, plugin_name: str) -> Callable[[str, Callable], None]:
        def register(name: str, factory: Callable) -> None:
            if name in self.factories:
                raise ValueError(
                    f"{self.what} '{name}' is registered by both plugin "
                    f"'{self.owners[name]}' and plugin '{plugin_name}'"
                )
            self.factories[name] = factory
            self.owners[name] = plugin_name

        return register

    def get(self, name: str) -> Callable:
        try:
            return self.factories[name]
        except KeyError:
            known = ", ".join(sorted(self.factories)) or "none"
            raise KeyError(f"unknown {self.what} '{name}' (registered: {known})") from None


def collect_backends(pm: pluggy.PluginManager, plugin_sections: dict[str, dict]) -> Registry:
    """Ask each plugin for its backend kinds, handing it only its own config section."""
    registry = Registry("backend kind")
    for impl in pm.hook.register_backends.get_hookimpls():
        impl.function(
            register=registry.register_from(impl.plugin_name),
            config=dict(plugin_sections.get(impl.plugin_name, {})),
        )
    return registry


def collect_routing_policies(pm: pluggy.PluginManager) -> Registry:
    registry = Registry("routing policy")
    for impl in pm.hook.register_routing_policies.get_hookimpls():
        impl.function(register=registry.register_from(impl.plugin_name))
    return registry


def collect_commands(pm: pluggy.PluginManager) -> Registry:
    registry = Registry("command")
    for impl in pm.hook.register_commands.get_hookimpls():
        impl.function(register=registry.register_from(impl.plugin_name))
    return registry


def notify(pm: pluggy.PluginManager, hook_name: str, **kwargs) -> None:
    """Call an observer hook; a failing observer is logged, never allowed to fail a request."""
    hook = getattr(pm.hook, hook_name)
    if not hook.get_hookimpls():
        return
    try:
        hook(**kwargs)
    except Exception:  # noqa: BLE001 - observers must not break serving
        log.exception("plugin hook %s failed", hook_name)
