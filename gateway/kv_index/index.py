"""Which deployments of one model hold which KV blocks: the index behind `precise_prefix`.

Fed by the engines' KV events (gateway.kv_index.events): a block hash maps to the deployments that
reported storing it and have not reported evicting it. A prompt's blocks are hashed the way the
engines hash them (vLLM v1's `sha256_cbor` chain, see `prefix_block_hashes`), and each deployment
scores the number of leading blocks it holds, as llm-d's LongestPrefix scorer does.

Bounded: at most `max_blocks` hashes; past that the least recently stored or looked-up one goes
(forgetting a block only makes routing miss a hit, never send a request where it cannot run).
Each deployment holds at most its share, `max_blocks` over the deployments that have stored
blocks: past it, its own oldest stored blocks go, so one publisher (a hostile one sending
millions of hashes, or a huge engine) cannot evict the others' blocks.

Provisional entries: the gateway records the blocks of a prompt it just sent to a deployment
(`provisional`), before that engine's BlockStored events could come, so the conversation's next
turn finds its engine even when it arrives first. Each expires after its TTL unless the
deployment's BlockStored confirms it (it is then an ordinary entry); BlockRemoved, a forgotten
deployment, or the bound (at most `max_blocks` provisional entries, oldest first) drop it sooner.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict, defaultdict, deque
from collections.abc import Iterable, Iterator
from functools import lru_cache

import cbor2


def _sha256_cbor(value) -> bytes:
    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


@lru_cache(maxsize=16)
def _root(seed: str) -> bytes:
    return _sha256_cbor(seed)  # vLLM's NONE_HASH for PYTHONHASHSEED=seed


def prefix_block_hashes(token_ids: list[int], block_size: int, seed: str, salt: str | None = None) -> list[int]:
    """The published hashes of the prompt's full blocks, in order: hash_i = sha256(canonical CBOR
    [hash_{i-1}, block_i tokens, extra keys]), the first parent sha256(CBOR(seed)), each published
    as its last 8 bytes read big-endian (vLLM's int block hashes). Extra keys are null, but for a
    request's cache_salt: [("cache_salt", salt)] on the first block (vLLM 0.32's
    generate_block_hash_extra_keys, and the native engine's block_manager.hash_block; vLLM's events
    show the bare salt in their extra_keys, its hash does not), so each salt's blocks are apart in
    the index too."""
    return list(iter_block_hashes(token_ids, block_size, seed, salt))


def iter_block_hashes(token_ids: list[int], block_size: int, seed: str, salt: str | None = None) -> Iterator[int]:
    """`prefix_block_hashes` one at a time: routing (on the event loop) stops hashing at the first
    block nobody holds, ~80 us a block (an 8k-token prompt whole: ~40 ms)."""
    parent = _root(seed)
    extra = (("cache_salt", salt),) if salt else None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = _sha256_cbor((parent, tuple(token_ids[start:start + block_size]), extra))
        extra = None
        yield int.from_bytes(parent[-8:], "big")


class KVIndex:
    """Block hash -> deployments holding it, LRU-bounded."""

    def __init__(self, max_blocks: int = 1_000_000):
        if max_blocks <= 0:
            raise ValueError(f"max_blocks must be positive, got {max_blocks}")
        self.max_blocks = max_blocks
        self._holders: OrderedDict[int, set[str]] = OrderedDict()
        # deployment -> the hashes it holds: forgetting one deployment touches its own blocks only
        # (in the order it stored them: past its share, its oldest go)
        self._held: defaultdict[str, OrderedDict[int, None]] = defaultdict(OrderedDict)
        self.evicted = 0  # hashes dropped to stay under max_blocks or a deployment's share
        # hash -> {deployment: expiry} of blocks the gateway sent and no event confirmed yet, and
        # (expiry, hash, deployment) in the order they were made, to expire and bound them
        self._provisional: dict[int, dict[str, float]] = {}
        self._provisional_order: deque[tuple[float, int, str]] = deque()

    def __len__(self) -> int:
        return len(self._holders)

    def blocks_of(self, deployment: str) -> int:
        held = self._held.get(deployment)
        return len(held) if held else 0

    def share(self, deployment: str) -> int:
        """The most blocks `deployment` may hold: an equal part of max_blocks."""
        others = len(self._held) - (deployment in self._held)
        return max(1, self.max_blocks // (others + 1))

    def provisional_count(self) -> int:
        return sum(len(holders) for holders in self._provisional.values())

    def provisional(self, deployment: str, hashes, ttl_s: float, now: float | None = None) -> None:
        """`deployment` was just sent a prompt with these blocks: count them as held until
        `ttl_s` passes, unless its events confirm them first (blocks it holds already stay)."""
        now = time.monotonic() if now is None else now
        expiry = now + ttl_s
        for h in hashes:
            holders = self._holders.get(h)
            if holders is not None and deployment in holders:
                continue
            self._provisional.setdefault(h, {})[deployment] = expiry
            self._provisional_order.append((expiry, h, deployment))
        while len(self._provisional_order) > self.max_blocks:
            self._unprovision(*self._provisional_order.popleft())

    def _expire(self, now: float) -> None:
        order = self._provisional_order
        while order and order[0][0] <= now:
            self._unprovision(*order.popleft())

    def _unprovision(self, expiry: float, h: int, deployment: str) -> None:
        """Drop one provisional entry, unless a later prompt renewed it (a later expiry)."""
        holders = self._provisional.get(h)
        if holders is not None and holders.get(deployment) == expiry:
            del holders[deployment]
            if not holders:
                del self._provisional[h]

    def _confirm(self, deployment: str, h: int) -> None:
        holders = self._provisional.get(h)
        if holders is not None and holders.pop(deployment, None) is not None and not holders:
            del self._provisional[h]

    def stored(self, deployment: str, hashes) -> None:
        held = self._held[deployment]
        for h in hashes:
            if self._provisional:
                self._confirm(deployment, h)
            holders = self._holders.get(h)
            if holders is None:
                holders = self._holders[h] = set()
            else:
                self._holders.move_to_end(h)
            holders.add(deployment)
            held[h] = None
            held.move_to_end(h)
        share = self.share(deployment)
        while len(held) > share:  # its own oldest, never another deployment's
            self._drop(deployment, held.popitem(last=False)[0])
            self.evicted += 1
        while len(self._holders) > self.max_blocks:  # shares shrank as deployments came
            h, gone = self._holders.popitem(last=False)
            for d in gone:
                self._held[d].pop(h, None)
            self.evicted += 1

    def _drop(self, deployment: str, h: int) -> None:
        holders = self._holders.get(h)
        if holders is not None:
            holders.discard(deployment)
            if not holders:
                del self._holders[h]

    def removed(self, deployment: str, hashes) -> None:
        for h in hashes:
            if self._provisional:
                self._confirm(deployment, h)  # gone from the engine: not held, provisionally or not
            holders = self._holders.get(h)
            if holders is not None and deployment in holders:
                holders.discard(deployment)
                self._held[deployment].pop(h, None)
                if not holders:
                    del self._holders[h]

    def forget(self, deployment: str) -> None:
        """Drop everything `deployment` was said to hold (it restarted, left, or lost events)."""
        for h in [h for h, holders in self._provisional.items() if deployment in holders]:
            self._confirm(deployment, h)  # rare (a restart, a departure): a scan of the bounded table
        held = self._held.pop(deployment, None)
        for h in held or ():
            holders = self._holders.get(h)
            if holders is not None:
                holders.discard(deployment)
                if not holders:
                    del self._holders[h]

    def longest_prefix(self, hashes: Iterable[int], deployments, now: float | None = None) -> dict[str, int]:
        """For each of `deployments`, how many of the leading `hashes` it holds without a break,
        confirmed or provisionally (read no further than the first hash none of them holds)."""
        matched = dict.fromkeys(deployments, 0)
        alive = set(matched)
        if self._provisional_order:
            self._expire(time.monotonic() if now is None else now)
        for i, h in enumerate(hashes):
            holders = self._holders.get(h)
            provisional = self._provisional.get(h)
            if holders is None and provisional is None:
                break
            if holders is not None:
                self._holders.move_to_end(h)  # a prefix that is asked for stays
            if provisional is not None:
                holders = (holders or set()) | provisional.keys()
            alive &= holders
            if not alive:
                break
            for d in alive:
                matched[d] = i + 1
        return matched
