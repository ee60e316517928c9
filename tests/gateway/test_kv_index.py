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
