"""`precise_prefix`: route to the deployment that holds the longest run of the prompt's KV blocks.

Engines publish which blocks they cache (gateway.kv_index.events); one index per model records them
(gateway.kv_index.index). For a request, the prompt becomes token ids before the policy chooses
(gateway.routing.prompt_tokens: the engine's own tokenizer in this process, or the backend's /tokenize; chat
through the same template), the token ids become the engines' chained block hashes, and each
candidate scores

    score(d) = prefix_weight * cached(d) / prompt_tokens  -  load_weight * load_score(d) / weight(d)

where cached(d) is the number of leading prompt tokens in blocks d holds (llm-d's LongestPrefix,
in tokens) and load_score the queue-and-KV score every load-aware policy uses (routing.load_score:
(running + 2 * waiting) / capacity + KV-cache use). With the default weights (1, 1) a deployment
holding the whole prompt wins until it is a full load unit busier than an empty one: a hot engine
with the prefix does not get everything. Ties go in turn.

When no candidate's events are live (no publisher declared, nothing heard yet) or the prompt could
not be tokenized, `prefix_affinity` decides instead; it also places a prompt no deployment holds
any block of, so that requests sharing a new prefix meet on one engine before any has cached it.
Routing stays advisory: a wrong guess costs a recompute on the chosen engine, never a failed request.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import OrderedDict

import zmq.asyncio

from gateway.kv_index.events import EventStream
from gateway.kv_index.index import KVIndex, iter_block_hashes
from gateway.policy import RoutingPolicy
from gateway.routing.policies import PrefixAffinity, load_score
from gateway.routing.prompt_tokens import PromptTokens

log = logging.getLogger("kvgate.routing")

MATCHES_KEPT = 4096  # recent choices whose matched prefix a route span may still ask for
OPTIONS = {"prefix_weight", "load_weight", "max_index_blocks", "max_prompt_chars", "tokenize_timeout_s",
           "tokenized_prompts_kept", "prefix_chars", "max_score"}


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
        unknown = set(options) - OPTIONS
        if unknown:
            raise ValueError(f"precise_prefix: unknown option(s) {', '.join(sorted(unknown))}; "
                             f"known: {', '.join(sorted(OPTIONS))}")
        self.prefix_weight = float(options.get("prefix_weight", 1.0))
        self.load_weight = float(options.get("load_weight", 1.0))
        if self.prefix_weight < 0 or self.load_weight < 0:
            raise ValueError("precise_prefix: prefix_weight and load_weight must be >= 0")
        self.max_prompt_chars = int(options.get("max_prompt_chars", 32768))
        timeout_s = float(options.get("tokenize_timeout_s", 0.25))
        kept = int(options.get("tokenized_prompts_kept", 1024))
        if self.max_prompt_chars < 0 or timeout_s <= 0 or kept <= 0:
            raise ValueError("precise_prefix: max_prompt_chars must be >= 0, tokenize_timeout_s and "
                             "tokenized_prompts_kept > 0")
        self.kv_feed = KVFeed(int(options.get("max_index_blocks", 1_000_000)),
                              PromptTokens(self.max_prompt_chars, timeout_s, kept))
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
        live = [d for d in deployments if d.started and self.kv_feed.live(d.name)]
        if live:
            await self.kv_feed.tokens.prepare(request, live)

    def choose(self, request, candidates):
        self.kv_feed.track(candidates)
        live = [d for d in candidates if self.kv_feed.live(d.name)]
        tokens = self.kv_feed.tokens.ids(request, live) if live else None
        if not tokens:
            return self._fallback.choose(request, candidates)
        cached = self._cached_tokens(tokens, live, _cache_salt(request))
        if not any(cached.values()):  # a new prefix: its home by affinity, so its next turns meet there
            self._remember(request, 0)
            return self._fallback.choose(request, candidates)
        scores = [self.prefix_weight * cached.get(d.name, 0) / len(tokens) - self.load_weight * load_score(d) / d.weight
                  for d in candidates]
        best = max(scores)
        ties = [i for i, s in enumerate(scores) if best - s < 1e-9]
        chosen = candidates[ties[next(self._turn) % len(ties)]]
        self._remember(request, cached.get(chosen.name, 0))
        return chosen

    def matched_tokens(self, request_id: str) -> int | None:
        """Prompt tokens the index said the chosen deployment holds; None: routed without it."""
        return self._matched.get(request_id)

    def _remember(self, request, tokens: int) -> None:
        request_id = getattr(request, "request_id", None)
        if request_id is not None:
            self._matched[request_id] = tokens
            if len(self._matched) > MATCHES_KEPT:
                self._matched.popitem(last=False)

    def _cached_tokens(self, tokens: list[int], live, salt: str | None = None) -> dict[str, int]:
        """Leading prompt tokens each live deployment holds in its cache, as the index knows it."""
        by_scheme: dict[tuple[int, str], list] = {}
        for d in live:
            source = self.kv_feed.streams[d.name].source
            by_scheme.setdefault((source.block_size, source.hash_seed), []).append(d.name)
        cached: dict[str, int] = {}
        for (block_size, seed), names in by_scheme.items():
            hashes = iter_block_hashes(tokens, block_size, seed, salt)  # hashed as far as the index matches
            for name, blocks in self.kv_feed.index.longest_prefix(hashes, names).items():
                cached[name] = blocks * block_size
        return cached


def _cache_salt(request) -> str | None:
    """The request's cache_salt (the client's, or its tenant's: gateway.protocol.completions):
    engines hash its blocks apart, so the index looks them up apart."""
    salt = (getattr(request, "extra", None) or {}).get("cache_salt")
    return salt if isinstance(salt, str) and salt else None
