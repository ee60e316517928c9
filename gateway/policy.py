"""The RoutingPolicy protocol: which of a pool's available deployments takes a request.

A policy plugin's classes subclass `RoutingPolicy` (as the built-in ones in gateway/routing/ do):
`choose` is the one member every policy defines; the others have defaults here, which a policy
overrides when it does more. The gateway calls every member directly, so a policy that does not
subclass `RoutingPolicy` is refused when its model's pool is built.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence, runtime_checkable


@runtime_checkable
class RoutingPolicy(Protocol):
    """Built once per model by its factory, `factory(options: dict)` (the model's
    `policy_options`); `ValueError` from the factory is a config error naming them."""

    # The policy's index of the engines' KV events (precise_prefix's KVFeed: follows the pool's
    # deployments, shown on /metrics and /status.json), or None for a policy that keeps none.
    kv_feed: Any = None

    def choose(self, request, candidates: Sequence) -> Any:
        """One of `candidates`: the pool's deployments that can take `request` now (started,
        healthy, breaker closed, not saturated, serving what it needs; never empty). Synchronous
        and cheap: it runs for every request, in the event loop. `request` is the backend
        request (gateway.backend: GenerationRequest, EmbeddingRequest, TokenizeRequest...)."""
        ...

    async def prepare(self, request, deployments: Sequence) -> None:
        """What the policy computes before it can choose, outside the synchronous `choose`
        (precise_prefix: the prompt's token ids, on threads or from a backend's /tokenize).
        Default: nothing."""

    def sibling(self) -> RoutingPolicy | None:
        """The policy instance for a disaggregated model's prefill hops: its turns and memory of
        choices apart, but what it may share with this one shared (precise_prefix: the KV index
        and its subscriptions). Default None: the factory builds an unrelated one."""
        return None

    def matched_tokens(self, request_id: str) -> int | None:
        """How many of the request's prompt tokens the chosen deployment was found to hold in its
        cache when it was chosen (traced as kvgate.kv_prefix_matched_tokens). Default None: the
        policy does not know."""
        return None
