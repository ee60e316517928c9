"""The gateway's KV index: the engines' hashes reproduced from token ids, longest-prefix scoring
(llm-d's LongestPrefix), removal, forgetting, and the LRU bound."""

from __future__ import annotations

import pytest

from gateway.kv_index.index import KVIndex, prefix_block_hashes
from native_backend.core.block_manager import BlockManager
from native_backend.core.kv_events import BlockStored
from native_backend.core.sequence import Sequence


@pytest.mark.parametrize("seed, block_size", [("0", 4), ("42", 16)])
def test_prompt_hashes_are_the_ones_the_engine_publishes(seed, block_size):
    bm = BlockManager(num_blocks=64, block_size=block_size, hash_seed=seed, record_kv_events=True)
    tokens = [(7919 * i) % 49152 for i in range(5 * block_size + 3)]
    seq = Sequence("a", tokens)
    bm.allocate_slots(seq, len(tokens))
    seq.num_computed_tokens = len(tokens)
    bm.cache_full_blocks(seq)
    stored = [e for e in bm.take_kv_events() if isinstance(e, BlockStored)]
    assert list(stored[0].block_hashes) == prefix_block_hashes(tokens, block_size, seed)
    assert prefix_block_hashes(tokens, block_size, "other seed") != prefix_block_hashes(tokens, block_size, seed)


@pytest.mark.parametrize("salt", ["tenant-a", "kvgate.0123abcd"])
def test_salted_prompt_hashes_are_the_engines_and_vllms(salt):
    """A cache_salt is the first block's extra keys: vLLM 0.32's hash_block_tokens(hash_fn, parent,
    tokens, extra_keys=(("cache_salt", salt),)) for block 0 and None after
    (generate_block_hash_extra_keys; tests/plugins/test_openai_vllm.py checks it on a real vLLM), recomputed
    here with cbor2 and hashlib, and the native engine publishes the same (issue 40 item 4)."""
    import hashlib

    import cbor2

    def sha(value):
        return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()

    tokens = [(7919 * i) % 49152 for i in range(3 * 4 + 1)]
    parent, expected = sha("0"), []
    for i in range(3):
        parent = sha((parent, tuple(tokens[4 * i:4 * i + 4]), (("cache_salt", salt),) if i == 0 else None))
        expected.append(int.from_bytes(parent[-8:], "big"))
    assert prefix_block_hashes(tokens, 4, "0", salt) == expected
    assert set(expected).isdisjoint(prefix_block_hashes(tokens, 4, "0"))  # apart from the unsalted
    bm = BlockManager(num_blocks=64, block_size=4, hash_seed="0", record_kv_events=True)
    seq = Sequence("a", tokens)
    seq.cache_salt = salt
    bm.allocate_slots(seq, len(tokens))
    seq.num_computed_tokens = len(tokens)
    bm.cache_full_blocks(seq)
    stored = [e for e in bm.take_kv_events() if isinstance(e, BlockStored)]
    assert list(stored[0].block_hashes) == expected


def test_one_deployment_flooding_the_index_evicts_only_its_own_blocks():
    """Each deployment holds at most an equal share of max_blocks: a publisher storing 10,000
    hashes in an index of 100 keeps its newest 50, and the other deployment's 40 stay (issue 40 item 5)."""
    index = KVIndex(max_blocks=100)
    index.stored("quiet", range(1, 41))
    index.stored("flood", range(1000, 11_000))
    assert index.blocks_of("quiet") == 40 and index.longest_prefix(range(1, 41), ["quiet"]) == {"quiet": 40}
    assert index.blocks_of("flood") == 50 and index.longest_prefix([10_999], ["flood"]) == {"flood": 1}
    assert len(index) <= 100


def test_longest_prefix_counts_leading_blocks_without_a_break():
    index = KVIndex()
    index.stored("a", [1, 2, 3])
    index.stored("b", [1, 3, 4])  # holds block 3 but not 2: its prefix stops at 1
    assert index.longest_prefix([1, 2, 3, 4], ["a", "b", "c"]) == {"a": 3, "b": 1, "c": 0}
    index.removed("a", [2])
    assert index.longest_prefix([1, 2, 3], ["a", "b"]) == {"a": 1, "b": 1}
    assert index.blocks_of("a") == 2 and index.blocks_of("b") == 3


def test_forgetting_a_deployment_leaves_the_others():
    index = KVIndex()
    index.stored("a", [1, 2])
    index.stored("b", [2, 3])
    index.forget("a")
    assert index.blocks_of("a") == 0 and len(index) == 2
    assert index.longest_prefix([2, 3], ["a", "b"]) == {"a": 0, "b": 2}


def test_the_index_is_bounded_and_keeps_what_is_looked_up():
    index = KVIndex(max_blocks=4)
    index.stored("a", [1, 2, 3, 4])
    index.longest_prefix([1], ["a"])  # 1 is now the most recently used
    index.stored("b", [5, 6])
    assert len(index) == 4 and index.evicted == 2
    assert index.longest_prefix([1], ["a"]) == {"a": 1}
    assert index.longest_prefix([2], ["a"]) == {"a": 0}  # the least recently used went first
    assert index.blocks_of("a") + index.blocks_of("b") == 4


def test_a_provisional_entry_counts_until_its_ttl_unless_an_event_confirms_it():
    """Blocks the gateway just sent to d0 count as d0's (issue 44 item 2) until the TTL passes; a
    BlockStored from d0 makes them ordinary entries, a BlockRemoved or a forget drops them."""
    index = KVIndex()
    index.provisional("d0", [1, 2, 3], ttl_s=10.0, now=100.0)
    assert index.longest_prefix([1, 2, 3, 4], ["d0", "d1"], now=105.0) == {"d0": 3, "d1": 0}
    assert index.longest_prefix([1, 2, 3], ["d0"], now=110.0) == {"d0": 0}  # expired at 110
    assert index.provisional_count() == 0

    index.provisional("d0", [1, 2, 3], ttl_s=10.0, now=200.0)
    index.stored("d0", [1, 2])  # the engine's events confirm two of them
    assert index.longest_prefix([1, 2, 3], ["d0"], now=205.0) == {"d0": 3}
    assert index.longest_prefix([1, 2, 3], ["d0"], now=1000.0) == {"d0": 2}  # 3 expired, 1-2 stay
    assert index.blocks_of("d0") == 2

    index.provisional("d1", [1, 2, 3], ttl_s=10.0, now=2000.0)
    index.removed("d1", [2])  # evicted by the engine before the TTL: not held any more
    assert index.longest_prefix([1, 2, 3], ["d1"], now=2001.0) == {"d1": 1}
    index.forget("d1")
    assert index.longest_prefix([1, 2, 3], ["d1"], now=2001.0) == {"d1": 0}
    assert index.provisional_count() == 0


def test_a_renewed_provisional_entry_keeps_its_later_expiry_and_the_table_is_bounded():
    index = KVIndex(max_blocks=4)
    index.provisional("d0", [1], ttl_s=10.0, now=0.0)
    index.provisional("d0", [1], ttl_s=10.0, now=8.0)  # the next turn sent the same block again
    assert index.longest_prefix([1], ["d0"], now=12.0) == {"d0": 1}  # the first expiry does not drop it
    index.provisional("d1", [10, 11, 12, 13, 14], ttl_s=100.0, now=12.0)
    assert index.provisional_count() <= 4
    assert index.longest_prefix([14], ["d1"], now=13.0) == {"d1": 1}  # the newest stay
