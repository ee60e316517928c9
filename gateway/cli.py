"""`kvgate serve` and `kvgate check-config`."""

from __future__ import annotations

import argparse
import gc
import logging
import sys

from gateway.config import ConfigError, load_config


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return args.func(args)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvgate", description="An OpenAI-compatible LLM inference gateway.")
    sub = parser.add_subparsers(required=True, metavar="COMMAND")
    serve = sub.add_parser("serve", help="serve the models of a config file")
    serve.add_argument("--config", required=True, help="YAML config file")
    serve.add_argument("--host", help="listen address (overrides server.host)")
    serve.add_argument("--port", type=int, help="listen port (overrides server.port)")
    serve.set_defaults(func=_serve)
    check = sub.add_parser("check-config", help="validate a config file without serving")
    check.add_argument("config", help="YAML config file")
    check.set_defaults(func=_check)
    _add_plugin_commands(sub)
    return parser


def _add_plugin_commands(sub) -> None:
    """Subcommands from plugins (`register_commands`): the engine's `plan` lives with the engine."""
    from gateway.plugins import collect_commands, make_plugin_manager

    for name, command in collect_commands(make_plugin_manager()).factories.items():
        if name in sub.choices:
            raise ValueError(f"plugin command '{name}' would replace the built-in 'kvgate {name}'")
        parser = sub.add_parser(name, help=command.help, description=command.help)
        command.add_arguments(parser)
        parser.set_defaults(func=command.run)


def _load_state(path: str):
    """Config plus plugins plus backends created (not started); errors printed, None returned."""
    from gateway.state import build_state

    try:
        return build_state(load_config(path), config_path=path)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
    except ValueError as exc:
        print(f"invalid config {path}:\n  {exc}", file=sys.stderr)
    return None


def _check(args) -> int:
    state = _load_state(args.config)
    if state is None:
        return 1
    models = ", ".join(p.name for p in state.registry.pools)
    groups = state.registry.groups()
    found = f", {len(groups)} found in DNS at run time" if groups else ""
    print(f"{args.config}: OK ({len(state.registry.deployments())} deployments{found}; models: {models})")
    for g in groups:  # not resolved here: the names may only exist where the gateway runs
        d = g.discovery
        print(f"  {g.model}/{g.name}: every address of {d.dns}, port {d.port}, every {d.refresh_s:g} s")
    return 0


# Container allocations between two young-generation collections (Python's default: 700). A
# request allocates ~100 that outlive it by a little (tasks, dicts, events), so at 700 the young
# generation was collected every ~7 requests: ~640 collections for 5,000 non-streamed requests at
# c=32, ~0.15 s of the loop's time; at 10,000, 19 collections and ~0.01 s. Garbage cycles wait
# for at most 10,000 allocations.
GC_YOUNG_THRESHOLD = 10_000


def _tune_gc() -> None:
    """Keep what start-up made (modules, config, plugins: ~90,000 objects for one openai
    deployment) out of the collector's full passes (one such pass paused the loop for ~75 ms
    under load), and collect the young generation less often (GC_YOUNG_THRESHOLD)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])


def _serve(args) -> int:
    import uvicorn

    from gateway.app import create_app
    from gateway.http.slow_clients import uvicorn_options

    state = _load_state(args.config)
    if state is None:
        return 1
    server = state.config.server
    logging.basicConfig(level=server.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = create_app(state)
    _tune_gc()
    uvicorn.run(
        app,
        host=args.host or server.host,
        port=server.port if args.port is None else args.port,
        log_level=server.log_level,
        timeout_graceful_shutdown=server.shutdown_timeout_s,
        **uvicorn_options(server),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
