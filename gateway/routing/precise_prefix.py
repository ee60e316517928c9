"""`precise_prefix`: route to the deployment that holds the longest run of the prompt's KV blocks.

Engines publish which blocks they cache (gateway.kv_index.events); one index per model records them
(gateway.kv_index.index). For a request, the prompt becomes token ids before the policy chooses
(gateway.routing.prompt_tokens: the engine's own tokenizer in this process, or the backend's /tokenize; chat
through the same template), the token ids become the engines' chained block hashes, cached(d) is
the number of leading prompt tokens in blocks d holds (llm-d's LongestPrefix, in tokens), and the
deployment with the least expected time to first token wins (gateway.routing.cost_model):

    estimate(d) = (queued_tokens(d) + prompt_tokens - cached(d)) / token_rate(d) + decoding(d) x step_s(d)

Ties go to the prompt's home by affinity among them. With `cost_model: false` each candidate scores
the older blend instead, prefix_weight * cached(d) / prompt_tokens - load_weight * load_score(d) /
weight(d), ties in turn. The blocks of each routed prompt become provisional entries of the chosen
deployment in the index (kv_index.index), so a conversation's next turn finds its engine before the
engine's events say it stored them.

When no candidate's events are live (no publisher declared, nothing heard yet) or the prompt could
not be tokenized, `prefix_affinity` decides instead; without the cost model it also places a prompt
no deployment holds any block of, so that requests sharing a new prefix meet on one engine.
Routing stays advisory: a wrong guess costs a recompute on the chosen engine, never a failed request.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import OrderedDict, deque

import zmq.asyncio

from gateway.kv_index.events import EventStream
from gateway.kv_index.index import KVIndex, iter_block_hashes
from gateway.policy import RoutingPolicy
from gateway.routing.cost_model import CostModel
from gateway.routing.options import check_known, weights
from gateway.routing.policies import PrefixAffinity, load_score
from gateway.routing.prompt_tokens import PromptTokens

log = logging.getLogger("kvgate.routing")

MATCHES_KEPT = 4096  # recent choices whose matched prefix a route span may still ask for
ROUTES_SHOWN = 32  # sampled routing decisions the status page shows
OPTIONS = {"prefix_weight", "load_weight", "max_index_blocks", "max_prompt_chars", "tokenize_timeout_s",
           "tokenized_prompts_kept", "prefix_chars", "max_score", "cost_model", "tokens_per_s", "step_s",
           "provisional_ttl_s", "provisional_max_blocks", "route_sample_every", "shared_compute"}


class KVFeed:
    """One model's KV index, the event streams of its deployments that publish them, and its
    recent prompts' token ids: shared by the policies routing the model (a disaggregated model's
    prefill hops and decode hops), so each engine is subscribed to once."""

    def __init__(self, max_blocks: int, tokens: PromptTokens):
        self.index = KVIndex(max_blocks)
        self.tokens = tokens
        self.streams: dict[str, EventStream] = {}
        self._incarnations: dict[str, int] = {}
        self._silent: set[str] = set()  # deployments that declare no events source
        self._retiring: set[asyncio.Task] = set()  # streams of deployments that left, closing
        self._context: zmq.asyncio.Context | None = None

    def track(self, deployments) -> None:
        """Subscribe to every deployment in `deployments` that declares a source and is not
        followed yet; forget one whose engine restarted (a new incarnation)."""
        for d in deployments:
            stream = self.streams.get(d.name)
            if stream is None and d.name not in self._silent:
                self._follow(d)
            elif stream is not None:
                self._check_restart(d, stream)

    def retain(self, deployments) -> None:
        """Stop following, and forget, every deployment not in `deployments` (it left discovery,
        drains, or was removed by a reload)."""
        keep = {d.name for d in deployments}
        self._silent &= keep
        for name in [n for n in self.streams if n not in keep]:
            stream = self.streams.pop(name)
            stream.forget("it left the pool")
            self._incarnations.pop(name, None)
            self._close_later(stream)

    def live(self, name: str) -> bool:
        stream = self.streams.get(name)
        return stream is not None and stream.live

    def subscribed(self, name: str) -> bool:
        """Connected to its publisher, whether or not it has published since: what it stores from
        now on reaches the index (what it stored before may not: a missed hit at worst)."""
        stream = self.streams.get(name)
        return stream is not None and (stream.live or stream.connected)

    async def close(self) -> None:
        self.tokens.close()
        streams, self.streams = list(self.streams.values()), {}
        for stream in streams:
            await stream.close()
        await asyncio.gather(*self._retiring, return_exceptions=True)
        if self._context is not None:
            self._context.destroy(linger=0)
            self._context = None

    def _follow(self, d) -> None:
        source = d.backend.kv_events_source()
        if source is None:
            self._silent.add(d.name)
            return
        if self._context is None:
            self._context = zmq.asyncio.Context()
        stream = EventStream(d.name, source, self.index, self._context)
        try:
            stream.start()
        except zmq.ZMQError as exc:  # a bad or taken address: routed without its events until it rejoins
            log.warning("KV events of deployment %s: cannot subscribe to %s: %s", d.name, source.endpoint, exc)
            self._silent.add(d.name)
            return
        self.streams[d.name] = stream
        self._incarnations[d.name] = d.backend.load().incarnation

    def _check_restart(self, d, stream: EventStream) -> None:
        incarnation = d.backend.load().incarnation
        if incarnation != self._incarnations.get(d.name, incarnation):
            stream.forget("its engine restarted")
        self._incarnations[d.name] = incarnation

    def _close_later(self, stream: EventStream) -> None:
        task = asyncio.get_running_loop().create_task(stream.close())
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)


class PrecisePrefix(RoutingPolicy):
    """The deployment holding the longest cached prefix of the prompt, blended with load."""

    def __init__(self, options: dict):
        check_known("precise_prefix", options, OPTIONS)
        self.prefix_weight, self.load_weight = weights("precise_prefix", options, "prefix_weight", "load_weight")
        self.max_prompt_chars = int(options.get("max_prompt_chars", 32768))
        timeout_s = float(options.get("tokenize_timeout_s", 0.25))
        kept = int(options.get("tokenized_prompts_kept", 1024))
        if self.max_prompt_chars < 0 or timeout_s <= 0 or kept <= 0:
            raise ValueError("precise_prefix: max_prompt_chars must be >= 0, tokenize_timeout_s and "
                             "tokenized_prompts_kept > 0")
        self.kv_feed = KVFeed(int(options.get("max_index_blocks", 1_000_000)),
                              PromptTokens(self.max_prompt_chars, timeout_s, kept))
        self.cost = _cost_model(options)
        self.shared_compute = options.get("shared_compute", False)
        if not isinstance(self.shared_compute, bool):
            raise ValueError("precise_prefix: shared_compute must be true or false")
        self.provisional_ttl_s = float(options.get("provisional_ttl_s", 30.0))
        # blocks hashed past those the lookup read, for provisional entries: on the event loop, ~80 us each
        self.provisional_blocks = int(options.get("provisional_max_blocks", 64))
        self.sample_every = int(options.get("route_sample_every", 8))
        if self.provisional_ttl_s < 0 or self.sample_every <= 0 or self.provisional_blocks < 0:
            raise ValueError("precise_prefix: provisional_ttl_s and provisional_max_blocks must be >= 0 "
                             "(0: off), route_sample_every > 0")
        self._routes: deque[dict] = deque(maxlen=ROUTES_SHOWN)
        self._routed = itertools.count()
        self._options = dict(options)
        self._fallback = PrefixAffinity({k: options[k] for k in ("prefix_chars", "max_score") if k in options})
        self._turn = itertools.count()
        # request id -> cached prompt tokens on the deployment chosen for it (for its route span)
        self._matched: OrderedDict[str, int] = OrderedDict()

    def sibling(self) -> "PrecisePrefix":
        """Another instance with the same options and the same KV feed (index, subscriptions,
        prompt ids), its own turns and memory of choices: a disaggregated model's prefill hops."""
        other = PrecisePrefix(self._options)
        other.kv_feed = self.kv_feed
        return other

    async def prepare(self, request, deployments) -> None:
        """Before `choose`: the prompt's token ids, off the event loop or from the backend's
        /tokenize, when a deployment's events are live (else there is nothing to match them to)."""
        live = [d for d in deployments if d.started and self._followed(d.name)]
        if live:
            await self.kv_feed.tokens.prepare(request, live)

    def choose(self, request, candidates):
        self.kv_feed.track(candidates)
        live = [d for d in candidates if self._followed(d.name)]
        tokens = self.kv_feed.tokens.ids(request, live) if live else None
        if not tokens:
            return self._fallback.choose(request, candidates)
        chains = {}
        cached = self._cached_tokens(tokens, live, _cache_salt(request), chains)
        estimate = None
        if self.cost is not None:
            chosen, estimate = self._cheapest(request, len(tokens), cached, candidates)
        elif not any(cached.values()):  # a new prefix: its home by affinity, so its next turns meet there
            chosen = self._fallback.choose(request, candidates)
        else:
            chosen = self._blended(len(tokens), cached, candidates)
        matched = cached.get(chosen.name, 0)
        self._remember(request, matched)
        self._provision(chosen, chains)
        self._sample(request, chosen, len(tokens), matched, estimate)
        return chosen

    def _followed(self, name: str) -> bool:
        """A deployment whose blocks the index can be asked for: its events are live; with the cost
        model, also one subscribed that has published nothing yet (an engine that has stored nothing
        since the gateway started or reloaded): the gateway's provisional entries and its queue
        then place the first requests, instead of every request on one prefix's affinity home."""
        return self.kv_feed.live(name) or (self.cost is not None and self.kv_feed.subscribed(name))

    def _blended(self, prompt_tokens: int, cached: dict[str, int], candidates):
        """Without the cost model: prefix_weight x cached share - load_weight x load score."""
        scores = [self.prefix_weight * cached.get(d.name, 0) / prompt_tokens
                  - self.load_weight * load_score(d) / d.weight for d in candidates]
        best = max(scores)
        ties = [i for i, s in enumerate(scores) if best - s < 1e-9]
        return candidates[ties[next(self._turn) % len(ties)]]

    def _cheapest(self, request, prompt_tokens: int, cached: dict[str, int], candidates):
        """The least expected time to first token (gateway.routing.cost_model); ties go to the
        prompt's home by affinity among them (a new prefix on idle engines: where its next
        requests meet). The chosen deployment's queue grows by what it must prefill."""
        unmatched = {d.name: prompt_tokens - cached.get(d.name, 0) for d in candidates}
        estimates = self.cost.estimates(candidates, unmatched, self.shared_compute)
        best = min(estimates.values())
        ties = [d for d in candidates if estimates[d.name] - best < 1e-9]
        chosen = ties[0] if len(ties) == 1 else self._fallback.home(request, ties)
        self.cost.routed(chosen, prompt_tokens - cached.get(chosen.name, 0))
        return chosen, estimates[chosen.name]

    def _provision(self, chosen, chains: dict) -> None:
        """The prompt's blocks become provisional entries of the chosen deployment (kv_index.index):
        its next turn finds them before the engine's events say they are stored."""
        stream = self.kv_feed.streams.get(chosen.name)
        if self.provisional_ttl_s <= 0 or self.provisional_blocks == 0 or stream is None:
            return
        chain = chains.get((stream.source.block_size, stream.source.hash_seed))
        if chain is not None:
            hashes = chain.beyond_read(self.provisional_blocks)
            self.kv_feed.index.provisional(chosen.name, hashes, self.provisional_ttl_s)

    def _sample(self, request, chosen, prompt_tokens: int, matched: int, estimate: float | None) -> None:
        """One routing decision in `route_sample_every`, for the status page."""
        if next(self._routed) % self.sample_every:
            return
        self._routes.append({"request_id": getattr(request, "request_id", None), "deployment": chosen.name,
                             "prompt_tokens": prompt_tokens, "matched_tokens": matched,
                             "estimate_ms": None if estimate is None else round(1000 * estimate, 1),
                             "at": time.time()})

    def recent_routes(self) -> list[dict]:
        """Sampled recent decisions: the prompt's tokens, the chosen deployment's cached prefix and
        (with the cost model) its expected time to first token; newest last."""
        return list(self._routes)

    def matched_tokens(self, request_id: str) -> int | None:
        """Prompt tokens the index said the chosen deployment holds; None: routed without it."""
        return self._matched.get(request_id)

    def _remember(self, request, tokens: int) -> None:
        request_id = getattr(request, "request_id", None)
        if request_id is not None:
            self._matched[request_id] = tokens
            if len(self._matched) > MATCHES_KEPT:
                self._matched.popitem(last=False)

    def _cached_tokens(self, tokens: list[int], live, salt: str | None = None,
                       chains: dict | None = None) -> dict[str, int]:
        """Leading prompt tokens each live deployment holds in its cache, as the index knows it
        (`chains`, when given, gets each hashing scheme's chain, to be hashed on if need be)."""
        by_scheme: dict[tuple[int, str], list] = {}
        for d in live:
            source = self.kv_feed.streams[d.name].source
            by_scheme.setdefault((source.block_size, source.hash_seed), []).append(d.name)
        cached: dict[str, int] = {}
        for (block_size, seed), names in by_scheme.items():
            chain = _Chain(iter_block_hashes(tokens, block_size, seed, salt))  # hashed as far as the index matches
            if chains is not None:
                chains[(block_size, seed)] = chain
            for name, blocks in self.kv_feed.index.longest_prefix(chain, names).items():
                cached[name] = blocks * block_size
        return cached


class _Chain:
    """A prompt's block hashes, computed as far as they are read and kept: the index lookup reads
    the leading ones, the provisional entries the rest."""

    def __init__(self, hashes):
        self._hashes = hashes
        self.done: list[int] = []

    def __iter__(self):
        yield from self.done
        for h in self._hashes:
            self.done.append(h)
            yield h

    def beyond_read(self, blocks: int) -> list[int]:
        """The hashes read so far and up to `blocks` more."""
        self.done.extend(itertools.islice(self._hashes, blocks))
        return self.done


def _cost_model(options: dict) -> CostModel | None:
    """The cost model of the options (`cost_model: false`: the prefix/load blend instead)."""
    enabled = options.get("cost_model", True)
    if not isinstance(enabled, bool):
        raise ValueError("precise_prefix: cost_model must be true or false")
    if not enabled:
        return None
    return CostModel(float(options.get("tokens_per_s", 2000.0)), float(options.get("step_s", 0.02)))


def _cache_salt(request) -> str | None:
    """The request's cache_salt (the client's, or its tenant's: gateway.protocol.completions):
    engines hash its blocks apart, so the index looks them up apart."""
    salt = (getattr(request, "extra", None) or {}).get("cache_salt")
    return salt if isinstance(salt, str) and salt else None
