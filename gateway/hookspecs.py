"""The plugin boundary. Each hookspec's docstring is its contract.

Plugins are modules (or objects) with functions marked `@hookimpl` and named like the specs
below; they are found through the `kvgate` entry-point group. Registration hooks take a
`register` callback, so a plugin can contribute several things and the gateway owns the tables.
Per-token work never goes through these hooks: the hot path calls `Backend` objects directly.
"""

from __future__ import annotations

import pluggy

PROJECT = "kvgate"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def register_backends(register, config):
    """Register backend kinds this plugin provides.

    Called once at start-up (and again on config reload). Call
    `register(kind: str, factory)` for each kind, where `factory(settings: dict, deployment: str)`
    returns a new object satisfying `gateway.backend.Backend`. `settings` is the deployment's
    `settings:` mapping from YAML, unvalidated: the factory validates it and raises `ValueError`
    with a message naming the bad field. `config` is this plugin's own section of the gateway
    config (`plugins.<kind>:`), or an empty dict. Registering a kind twice is an error.

    A backend declares what it serves with `capabilities() -> gateway.backend.Capabilities`
    (endpoints such as chat, completions, embeddings, tokenize; request features such as tools,
    json_object, json_schema, logprobs, n, reasoning; vendor fields it takes verbatim), called
    once when the deployment is built: the gateway sends it only requests those cover, and
    answers 400 for a model none of whose deployments can serve a request. Without the method,
    a backend serves chat and completions with logprobs and n. See docs/api-surface.md.
    """


@hookspec
def register_routing_policies(register):
    """Register routing policies this plugin provides.

    Called once at start-up. Call `register(name: str, factory)` where `factory(options: dict)`
    returns an instance of a `gateway.policy.RoutingPolicy` subclass (`choose(request, candidates)
    -> candidate`, and the optional members it overrides). Registering a name twice is an error.
    """


@hookspec
def register_commands(register):
    """Register `kvgate` subcommands this plugin provides (the native engine's `kvgate plan`).

    Called once each time the `kvgate` command line is built. Call `register(name: str, command)`
    for each, where `command` has `help` (one line for `kvgate --help`),
    `add_arguments(parser: argparse.ArgumentParser)` and `run(args: argparse.Namespace) -> int`
    (the exit status). Every invocation builds every command's parser, so keep heavy imports
    inside `run`. A name registered twice, or a built-in command's name, is an error.
    """


@hookspec
def request_started(request_id, model, sla_class):
    """Called once when a request has been validated and is about to be routed.

    Observers only: the return value is ignored and an exception is logged, not raised.
    """


@hookspec
def request_finished(request_id, model, status, usage):
    """Called once when a request has ended, however it ended.

    `status` is the HTTP status of the answer (an int), "stream_error" for a stream that started
    and then ended with an error event, or 499 when the client went away first. `usage` is the
    OpenAI usage dict sent to the client, or None. Observers only: the return value is ignored and
    an exception is logged, not raised.
    """
