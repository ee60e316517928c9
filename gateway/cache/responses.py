"""The exact response cache of one model: look a request up, replay a hit, keep a finished answer.

    lookup   a deterministic request (entries.cacheable) without Cache-Control no-cache/no-store:
             its entry, or a miss that remembers the key; others pass by (not cached)
    replay   a hit becomes choices that yield the kept events, through the same writers as a live
             answer (fresh id and created, stream_options as this request asks)
    keep     the events of an answer that finished (status 200, every choice stopped, hit its
             length or called tools); never an error, a cut answer or a hit
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass, field

from prometheus_client import Counter

from gateway.cache.entries import STORED_FINISH_REASONS, cache_key, cacheable, decode, encode
from gateway.cache.stores import MemoryCache, RedisCache
from gateway.config import GatewayConfig, ResponseCacheConfig

HEADER = "x-kvgate-cache"
# Decoded entries kept beside the store (ResponseCache._decoded): bounded by count and entry size,
# so they add at most ~64 x 64 KiB of encoded answers (a few MiB of objects) to max_bytes.
DECODED_ENTRIES = 64
DECODED_ENTRY_BYTES = 64 * 1024


@dataclass
class Lookup:
    """One request's dealings with the cache: its key, whether to keep its answer, what it found."""

    key: str
    store: bool
    hit: bytes | None = None
    batches: list = field(default_factory=list)  # (index, events) as they arrived, for keeping

    def tokens(self, index: int, events) -> None:
        self.batches.append((index, events))


class ReplayChoice:
    """A cached choice, shaped like dispatch.choices.OpenChoice where the writers read one."""

    def __init__(self, index: int, batches: list):
        self.index = index
        self.events = [e for batch in batches for e in batch]  # one batch: written out in one go
        self.first = batches[0] if batches else []
        self.closed = False
        self.last_event = None  # no kv_transfer_params: a hit never answers a prefill hop

    async def stream(self):
        yield self.events

    async def close(self) -> None:
        self.closed = True


class ResponseCache:
    def __init__(self, model: str, cfg: ResponseCacheConfig, store, requests: Counter):
        self.model, self.cfg, self.store, self._requests = model, cfg, store, requests
        self._counted: dict[str, object] = {}  # outcome -> its labelled series, looked up once
        self._recent: OrderedDict[str, tuple[bytes, dict]] = OrderedDict()  # key -> (entry, decoded), LRU first

    def _count(self, outcome: str) -> None:
        series = self._counted.get(outcome)
        if series is None:
            series = self._counted[outcome] = self._requests.labels(self.model, outcome)
        series.inc()

    def scope(self, key) -> str:
        if key is None or self.cfg.scope == "shared":
            return ""
        if self.cfg.scope == "team" and key.team is not None:
            return f"team={key.team}"
        return f"key={key.name}"

    async def lookup(self, parsed, key, headers) -> Lookup:
        """The request's entry, if any; one that does not use the cache (not deterministic,
        no-store, passthrough) is a miss that keeps nothing."""
        control = headers.get("cache-control", "").lower()
        if "no-store" in control or not cacheable(parsed, self.cfg.tools):
            self._count("bypass")
            return Lookup("", store=False)
        found = Lookup(cache_key(parsed, self.model, self.scope(key)), store=True)
        if "no-cache" not in control:
            found.hit = await self.store.get(found.key)
        self._count("hit" if found.hit is not None else "miss")
        return found

    def replay(self, found: Lookup) -> list[ReplayChoice]:
        return [ReplayChoice(index, batches) for index, batches in sorted(self._decoded(found).items())]

    def _decoded(self, found: Lookup) -> dict:
        """The hit's events, decoded once per entry while it stays hot: a small LRU of decoded
        entries (of at most DECODED_ENTRY_BYTES each), used only while the store still answers
        the same bytes under that key (events are frozen: replays share them)."""
        kept = self._recent.get(found.key)
        if kept is not None and kept[0] == found.hit:
            self._recent.move_to_end(found.key)
            return kept[1]
        events = decode(found.hit)
        if len(found.hit) <= DECODED_ENTRY_BYTES:
            self._recent[found.key] = (found.hit, events)
            self._recent.move_to_end(found.key)
            if len(self._recent) > DECODED_ENTRIES:
                self._recent.popitem(last=False)
        return events

    def keep(self, found: Lookup, status: int, finish_reasons, error) -> None:
        if found.hit is not None or not found.store or status != 200 or error is not None:
            return
        if not finish_reasons or any(r not in STORED_FINISH_REASONS for r in finish_reasons):
            return
        self.store.put(found.key, encode(found.batches))
        self._count("stored")


def make_caches(config: GatewayConfig, requests: Counter, env=None) -> dict[str, ResponseCache]:
    """A cache per model that configures one (its name and aliases resolve to the model's)."""
    env = os.environ if env is None else env
    out = {}
    for m in config.models:
        if m.cache is None:
            continue
        if m.cache.store == "memory":
            store = MemoryCache(m.cache.max_bytes, m.cache.ttl_s)
        else:
            where = config.auth.limits_store
            url = env.get(where.url_env or "")
            if not url:
                raise ValueError(f"models[{m.name}].cache.store: redis needs auth.limits_store.url_env set")
            password = env.get(where.password_env) if where.password_env else None
            store = RedisCache(url, f"{where.key_prefix}:cache:{m.name}", m.cache.max_bytes, m.cache.ttl_s,
                               where.timeout_s, password)
        out[m.name] = ResponseCache(m.name, m.cache, store, requests)
    return out
