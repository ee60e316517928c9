"""Paged KV-cache bookkeeping: fixed-size blocks, ref counts, and a prefix cache.

The KV cache is `num_blocks` blocks of `block_size` token slots. A sequence's `block_table` lists
the physical blocks that hold its positions in order. Nothing here touches tensors: the model
runner turns block tables into slot mappings.

Prefix caching: once every slot of a block holds computed KV, the block gets a hash chained with
its prefix, so equal hashes mean equal token histories up to the end of the block. The hash is
vLLM v1's `sha256_cbor` scheme (SHA-256 of canonical CBOR `[parent, tokens, null]`, the first
block's parent derived from a seed like vLLM's PYTHONHASHSEED), so that one router's index can
hold the blocks of our engines and of vLLM engines alike (see `kv_events`). Another request whose prompt starts with the same blocks reuses them (ref count +1)
instead of recomputing. A cached block nobody references is not freed outright: it waits in an
LRU, still findable by hash, and is evicted only when a block is needed and no never-cached free
block is left.

    block states:
        free (no hash) ──allocate──> in use (ref >= 1) ──last ref dropped──> free (no hash)
                                          │  ^                                   ^
                          full & computed │  │ prefix hit                          │ evict (LRU)
                               (hash set) v  │                                   │
                                     in use + hashed ──last ref dropped──> cached (ref 0, LRU)
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from dataclasses import dataclass

import cbor2

from native_backend.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, external_hash
from native_backend.core.sequence import Sequence

DEFAULT_HASH_SEED = "0"  # as PYTHONHASHSEED=0 for vLLM: engines with the same seed share hashes


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _sha256_cbor(value) -> bytes:
    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


def root_hash(seed: str) -> bytes:
    """The parent of a sequence's first block: vLLM's NONE_HASH for PYTHONHASHSEED=`seed`."""
    return _sha256_cbor(seed)


def hash_block(parent_hash: bytes, token_ids: list[int], extra_keys: tuple | None = None) -> bytes:
    """Chained block hash: depends on the block's tokens and, through the parent, on all before.
    `extra_keys` as vLLM's (kv_cache_utils.generate_block_hash_extra_keys): here a request's
    cache_salt and its LoRA adapter, on its first block alone (every later block chains through
    that one); no multimodal keys in this engine."""
    return _sha256_cbor((parent_hash, tuple(token_ids), extra_keys))


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None  # set once the block is full and computed (and caching is on)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True,
                 hash_seed: str = DEFAULT_HASH_SEED, record_kv_events: bool = False):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks without a hash: handed out first, so cached KV lives as long as possible.
        self._free_ids: deque[int] = deque(range(num_blocks))
        # Unreferenced blocks that still hold cached KV, least recently released first.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._root_hash = root_hash(hash_seed)
        self._hash_to_block: dict[bytes, int] = {}
        # request_id -> how many leading blocks of its table were offered to the prefix cache.
        self._num_registered: dict[str, int] = {}
        # Prefix-cache effectiveness, in tokens (as vLLM counts it).
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        # What entered and left the prefix cache since the last take_kv_events (None: not kept).
        self._kv_events: list[KVEvent] | None = [AllBlocksCleared()] if record_kv_events else None

    # --- capacity --------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: never-cached free ones plus evictable cached ones."""
        return len(self._free_ids) + len(self._evictable)

    @property
    def num_cached_free_blocks(self) -> int:
        return len(self._evictable)

    def usage(self) -> float:
        """Fraction of blocks referenced by some sequence, in [0, 1]."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def ref_count(self, block_id: int) -> int:
        return self.blocks[block_id].ref_count

    def is_free(self, block_id: int) -> bool:
        return block_id in self._evictable or block_id in self._free_ids

    # --- prefix lookup ---------------------------------------------------------------------

    def get_computed_prefix(self, seq: Sequence) -> int:
        """Number of leading tokens of `seq` whose KV is already in the prefix cache.

        A multiple of block_size, and always short of the last token: that one must run through
        the model so there is a logit to sample the next token from. Pure query: no ref counts
        or statistics change (the scheduler may ask again next step if admission fails).
        """
        if not self.enable_prefix_caching or seq.block_table:
            return 0
        max_cached_blocks = (seq.num_tokens - 1) // self.block_size
        return len(self._hit_blocks(seq, max_cached_blocks)) * self.block_size

    def _hit_blocks(self, seq: Sequence, max_blocks: int) -> list[int]:
        hits = []
        for block_hash in self._full_block_hashes(seq, max_blocks):
            block_id = self._hash_to_block.get(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def block_hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """Chained hashes of seq's first `num_blocks` full blocks, prefix caching on or off: what
        names a block's content across engines with the same seed (kv_connector checks them)."""
        return list(self._full_block_hashes(seq, num_blocks))

    def _full_block_hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """Chained hashes of seq's first `num_blocks` full blocks (memoized on the sequence)."""
        hashes = seq.block_hashes
        num_blocks = min(num_blocks, seq.num_tokens // self.block_size)
        while len(hashes) < num_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else self._root_hash
            tokens = seq.token_ids(i * self.block_size, (i + 1) * self.block_size)
            hashes.append(hash_block(parent, tokens, _extra_keys(seq) if i == 0 else None))
        return hashes[:num_blocks]

    # --- allocation ------------------------------------------------------------------------

    def num_blocks_to_allocate(self, seq: Sequence, num_new_tokens: int, num_cached_tokens: int = 0) -> int:
        """Free blocks an allocate_slots call with these arguments would consume."""
        if num_cached_tokens:
            hits = self._hit_blocks(seq, num_cached_tokens // self.block_size)
            # Cached hits with no other user sit in the evictable pool: reviving them uses it up.
            revived = sum(1 for b in hits if self.blocks[b].ref_count == 0)
            return cdiv(num_cached_tokens + num_new_tokens, self.block_size) - len(hits) + revived
        needed = cdiv(seq.num_computed_tokens + num_new_tokens, self.block_size)
        return max(0, needed - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new_tokens: int, num_cached_tokens: int = 0) -> bool:
        return self.num_blocks_to_allocate(seq, num_new_tokens, num_cached_tokens) <= self.num_free_blocks

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, num_cached_tokens: int = 0) -> None:
        """Grow seq.block_table to cover num_computed_tokens + num_new_tokens positions.

        With num_cached_tokens (from get_computed_prefix, on a sequence holding no blocks), the
        cached prefix blocks are attached first and num_computed_tokens jumps past them.

            block_size = 4, num_computed_tokens = 6, num_new_tokens = 5

            position     0  1  2  3 | 4  5  6  7 | 8  9 10 11
            block_table [    b7     |     b2     |    b9     ]   b9: allocated here
                         computed ───────┘  new ─────────┘       (slot 11 stays empty)

            blocks needed = cdiv(6 + 5, 4) = 3; len(block_table) was 2, so allocate 1.

        The caller checks can_allocate first; running out here is a bug, not back-pressure.
        """
        if not self.can_allocate(seq, num_new_tokens, num_cached_tokens):
            raise RuntimeError(f"out of KV blocks for {seq.request_id}: check can_allocate first")
        if not seq.block_table:
            self._attach_cached_prefix(seq, num_cached_tokens)
        needed = cdiv(seq.num_computed_tokens + num_new_tokens, self.block_size)
        while len(seq.block_table) < needed:
            seq.block_table.append(self._take_free_block())

    def _attach_cached_prefix(self, seq: Sequence, num_cached_tokens: int) -> None:
        hits = self._hit_blocks(seq, num_cached_tokens // self.block_size)
        for block_id in hits:
            self._acquire(block_id)
        seq.block_table.extend(hits)
        seq.num_computed_tokens = len(hits) * self.block_size
        self._num_registered[seq.request_id] = len(hits)
        if self.enable_prefix_caching:
            self.prefix_cache_queries += seq.num_tokens
            self.prefix_cache_hits += seq.num_computed_tokens

    def _acquire(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            self._evictable.pop(block_id)
        block.ref_count += 1

    def _take_free_block(self) -> int:
        if self._free_ids:
            block_id = self._free_ids.popleft()
        else:
            block_id, _ = self._evictable.popitem(last=False)  # least recently released
            self._note_removed(self._forget_hash(self.blocks[block_id]))
        self.blocks[block_id].ref_count = 1
        return block_id

    def _forget_hash(self, block: Block) -> bytes | None:
        forgotten = block.block_hash
        if forgotten is not None and self._hash_to_block.get(forgotten) == block.block_id:
            del self._hash_to_block[forgotten]
        block.block_hash = None
        return forgotten

    # --- prefix registration ---------------------------------------------------------------

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register seq's blocks that became full and fully computed, so later requests reuse them.

        Only tokens that are both computed and part of the sequence count: speculative draft
        tokens (computed but not accepted yet) never enter the cache.
        """
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens, seq.num_tokens) // self.block_size
        start = self._num_registered.get(seq.request_id, 0)
        if num_full <= start:
            return
        hashes = self._full_block_hashes(seq, num_full)
        stored = [i for i in range(start, num_full) if self._register(seq.block_table[i], hashes[i])]
        self._num_registered[seq.request_id] = num_full
        if self._kv_events is not None and stored:
            self._note_stored(seq, hashes, stored)

    def _register(self, block_id: int, block_hash: bytes) -> bool:
        """Whether the block became the cached copy of its hash."""
        # Two requests may compute the same block concurrently; the first one to finish it stays
        # the cached copy, the duplicate stays unhashed and returns to the free list when released.
        if block_hash in self._hash_to_block:
            return False
        self.blocks[block_id].block_hash = block_hash
        self._hash_to_block[block_hash] = block_id
        return True

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (vLLM's reset_prefix_cache, for an operator or a cold-start
        benchmark): no later request reuses KV computed before. Blocks that running sequences hold
        keep their KV for them, unhashed (they return to the free list when released); cached
        free blocks become plain free blocks. Subscribers are told AllBlocksCleared, which
        supersedes the changes not yet taken."""
        for block_id in self._hash_to_block.values():
            self.blocks[block_id].block_hash = None
        self._hash_to_block.clear()
        self._free_ids.extend(self._evictable)
        self._evictable.clear()
        if self._kv_events is not None:
            self._kv_events = [AllBlocksCleared()]

    # --- KV events (what a router's index learns; process.kv_publisher sends them) -----------

    def take_kv_events(self) -> list[KVEvent]:
        """The prefix cache's changes since the last call, in order; [] when not recording. The
        first call after start returns AllBlocksCleared first: whatever a subscriber knew of this
        engine's cache from before is gone."""
        if self._kv_events is None:
            return []
        events, self._kv_events = self._kv_events, []
        return events

    def _note_stored(self, seq: Sequence, hashes: list[bytes], stored: list[int]) -> None:
        """One BlockStored per run of consecutive newly cached blocks, chained to the block
        before the run (None for a sequence's first block), as vLLM's cache_full_blocks does."""
        runs: list[list[int]] = []
        for i in stored:
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        size = self.block_size
        for run in runs:
            first, end = run[0], run[-1] + 1
            self._kv_events.append(BlockStored(
                block_hashes=tuple(external_hash(hashes[i]) for i in run),
                parent_block_hash=external_hash(hashes[first - 1]) if first else None,
                token_ids=tuple(seq.token_ids(first * size, end * size)),
                block_size=size,
                lora_name=seq.lora_name,
            ))

    def _note_removed(self, block_hash: bytes | None) -> None:
        if self._kv_events is None or block_hash is None:
            return
        last = self._kv_events[-1] if self._kv_events else None
        if isinstance(last, BlockRemoved):  # evictions of one step travel as one event
            last.block_hashes.append(external_hash(block_hash))
        else:
            self._kv_events.append(BlockRemoved([external_hash(block_hash)]))

    # --- release ---------------------------------------------------------------------------

    def free(self, seq: Sequence) -> None:
        """Drop all of seq's blocks (finish, abort, or preemption); its KV counts as gone."""
        # Tail first: when all of a sequence's blocks go to the LRU, its later (less shareable)
        # blocks are evicted before its prefix.
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        seq.block_table = []
        seq.num_computed_tokens = 0
        self._num_registered.pop(seq.request_id, None)

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        assert block.ref_count >= 0, f"block {block_id} released more often than acquired"
        if block.ref_count > 0:
            return
        if block.block_hash is not None:
            self._evictable[block_id] = None  # most recently released: evicted last
        else:
            self._free_ids.append(block_id)

    def rollback(self, seq: Sequence, num_tokens: int) -> None:
        """Un-do the last `num_tokens` computed slots of seq (rejected speculative tokens).

            block_size = 4, num_computed_tokens 10 -> 7 (rollback 3)

            position     0  1  2  3 | 4  5  6  7 | 8  9
            before      [    b7     |     b2     |  b9  ]   computed: positions 0..9
            after       [    b7     |     b2     ]          computed: positions 0..6
                                                 b9 released; position 7's slot is rewritten later

        Rolled-back slots are never hashed (cache_full_blocks skips uncommitted tokens), so no
        shared cached block is ever rewritten.
        """
        if not 0 <= num_tokens <= seq.num_computed_tokens:
            raise ValueError(f"cannot roll back {num_tokens} of {seq.num_computed_tokens} tokens")
        new_computed = seq.num_computed_tokens - num_tokens
        registered = self._num_registered.get(seq.request_id, 0)
        if new_computed < registered * self.block_size:
            raise ValueError("cannot roll back into blocks already registered in the prefix cache")
        keep = cdiv(new_computed, self.block_size)
        for block_id in reversed(seq.block_table[keep:]):
            self._release(block_id)
        del seq.block_table[keep:]
        seq.num_computed_tokens = new_computed


def _extra_keys(seq: Sequence) -> tuple | None:
    """What the first block's hash takes beside its tokens, in vLLM 0.32's order and form
    (kv_cache_utils.generate_block_hash_extra_keys): the LoRA adapter, then ("cache_salt", salt);
    None for a plain request (hashes as before). vLLM keys every block with ("lora", name, path);
    here the adapter's name on the first block keys the chain (the gateway hashes no adapters)."""
    keys = ((("lora", seq.lora_name),) if seq.lora_name else ()) + ((("cache_salt", seq.cache_salt),)
                                                                     if seq.cache_salt else ())
    return keys or None
