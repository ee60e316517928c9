"""BlockManager: slot arithmetic, ref counts, prefix caching, LRU eviction, rollback."""

from __future__ import annotations

import pytest

from native_backend.core.block_manager import BlockManager, hash_block, root_hash
from native_backend.core.sequence import Sequence


def seq(request_id: str, tokens: list[int]) -> Sequence:
    return Sequence(request_id, tokens)


def compute(bm: BlockManager, s: Sequence, num_tokens: int | None = None) -> None:
    """Allocate and 'compute' the next num_tokens tokens (all remaining by default), as the
    scheduler + runner would: allocate, advance, register full blocks."""
    num_tokens = s.num_uncomputed_tokens if num_tokens is None else num_tokens
    bm.allocate_slots(s, num_tokens)
    s.num_computed_tokens += num_tokens
    bm.cache_full_blocks(s)


def admit(bm: BlockManager, s: Sequence) -> int:
    """Admit with the prefix cache and compute the rest; returns the cached token count."""
    cached = bm.get_computed_prefix(s)
    bm.allocate_slots(s, s.num_tokens - cached, cached)
    s.num_computed_tokens = s.num_tokens
    bm.cache_full_blocks(s)
    return cached


def test_allocate_grows_table_to_cover_computed_plus_new():
    bm = BlockManager(num_blocks=8, block_size=4)
    s = seq("a", list(range(10)))
    bm.allocate_slots(s, 6)
    assert len(s.block_table) == 2  # positions 0..5
    s.num_computed_tokens = 6
    bm.allocate_slots(s, 5)  # positions 6..10 -> needs a third block
    assert len(s.block_table) == 3
    assert bm.num_free_blocks == 5
    assert bm.usage() == pytest.approx(3 / 8)
    assert all(bm.ref_count(b) == 1 for b in s.block_table)


def test_allocation_within_the_last_block_takes_no_new_block():
    bm = BlockManager(num_blocks=8, block_size=4)
    s = seq("a", list(range(5)))
    compute(bm, s)  # 5 tokens: 2 blocks, 3 slots left in the second
    assert len(s.block_table) == 2
    assert bm.num_blocks_to_allocate(s, 3) == 0
    assert bm.num_blocks_to_allocate(s, 4) == 1


def test_cannot_allocate_past_capacity_and_allocate_refuses():
    bm = BlockManager(num_blocks=2, block_size=4)
    s = seq("a", list(range(12)))
    assert bm.can_allocate(s, 8)
    assert not bm.can_allocate(s, 9)
    with pytest.raises(RuntimeError):
        bm.allocate_slots(s, 9)
    assert s.block_table == [] and bm.num_free_blocks == 2


def test_free_returns_every_block_and_resets_progress():
    bm = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    s = seq("a", list(range(10)))
    compute(bm, s)
    bm.free(s)
    assert s.block_table == [] and s.num_computed_tokens == 0
    assert bm.num_free_blocks == 4 and bm.usage() == 0.0
    assert all(bm.ref_count(b) == 0 for b in range(4))


def test_only_full_computed_blocks_get_a_hash():
    bm = BlockManager(num_blocks=8, block_size=4)
    s = seq("a", list(range(10)))
    compute(bm, s, 3)
    assert all(bm.blocks[b].block_hash is None for b in s.block_table)
    compute(bm, s, 6)  # 9 computed: blocks 0 and 1 full, block 2 holds one token
    hashed = [bm.blocks[b].block_hash is not None for b in s.block_table]
    assert hashed == [True, True, False]
    assert bm.blocks[s.block_table[1]].block_hash == hash_block(hash_block(root_hash("0"), [0, 1, 2, 3]), [4, 5, 6, 7])


def test_uncomputed_tokens_are_never_cached():
    # Slots allocated (e.g. for speculative drafts) but not computed, or beyond the known tokens.
    bm = BlockManager(num_blocks=8, block_size=4)
    s = seq("a", list(range(6)))
    bm.allocate_slots(s, 8)
    s.num_computed_tokens = 8  # 2 slots past the 6 known tokens
    bm.cache_full_blocks(s)
    assert [bm.blocks[b].block_hash is not None for b in s.block_table] == [True, False]


def test_prefix_hit_shares_blocks_and_counts_tokens():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = seq("a", list(range(12)))
    assert admit(bm, a) == 0
    b = seq("b", list(range(8)) + [100, 101, 102])
    assert bm.get_computed_prefix(b) == 8
    assert admit(bm, b) == 8
    assert b.block_table[:2] == a.block_table[:2]
    assert b.block_table[2] not in a.block_table
    assert [bm.ref_count(x) for x in a.block_table] == [2, 2, 1]
    assert bm.prefix_cache_queries == 12 + 11
    assert bm.prefix_cache_hits == 8


def test_prefix_hit_always_leaves_the_last_token_to_compute():
    bm = BlockManager(num_blocks=16, block_size=4)
    admit(bm, seq("a", list(range(8))))
    twin = seq("b", list(range(8)))  # both blocks cached, but the last token needs a logit
    assert bm.get_computed_prefix(twin) == 4
    longer = seq("c", list(range(9)))
    assert bm.get_computed_prefix(longer) == 8


def test_hashes_are_chained_same_block_after_a_different_prefix_misses():
    bm = BlockManager(num_blocks=16, block_size=4)
    admit(bm, seq("a", [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    other_prefix = seq("b", [9, 9, 9, 9, 5, 6, 7, 8, 9])
    assert bm.get_computed_prefix(other_prefix) == 0
    second_block_first = seq("c", [5, 6, 7, 8, 9])  # a's 2nd block's tokens, at position 0
    assert bm.get_computed_prefix(second_block_first) == 0


def test_released_cached_blocks_stay_reusable_until_evicted():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = seq("a", list(range(9)))
    admit(bm, a)
    a_blocks = list(a.block_table)
    bm.free(a)
    assert bm.num_free_blocks == 4 and bm.num_cached_free_blocks == 2  # 2 full blocks kept
    b = seq("b", list(range(9)))
    assert admit(bm, b) == 8
    assert b.block_table[:2] == a_blocks[:2]  # revived from the LRU, ref 0 -> 1
    assert bm.num_cached_free_blocks == 0


def test_fresh_blocks_are_used_before_evicting_cached_ones():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = seq("a", list(range(8)) + [50])
    admit(bm, a)
    bm.free(a)  # 2 cached, 2 never-cached free
    filler = seq("f", [70] * 8)
    compute(bm, filler)
    assert bm.get_computed_prefix(seq("a2", list(range(8)) + [51])) == 8  # nothing evicted


def test_lru_evicts_least_recently_released_first():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = seq("a", [1] * 4 + [2] * 4)  # 2 full blocks each, all 4 cached
    b = seq("b", [3] * 4 + [4] * 4)
    compute(bm, a)
    compute(bm, b)
    bm.free(a)  # released first (tail block first) -> evicted first
    bm.free(b)
    assert bm.num_cached_free_blocks == 4

    def cached_prefix_of(s: Sequence) -> int:  # a query one token longer, so all blocks count
        return bm.get_computed_prefix(seq("q", s.prompt_token_ids + [0]))

    compute(bm, seq("c", [9] * 4))  # needs 1 block: evicts a's tail block
    assert (cached_prefix_of(a), cached_prefix_of(b)) == (4, 8)
    compute(bm, seq("d", [8] * 8))  # 2 more: a's head block, then b's tail block
    assert (cached_prefix_of(a), cached_prefix_of(b)) == (0, 4)


def test_can_allocate_counts_revived_cached_blocks():
    # 3 blocks; 2 of them cached and unreferenced. A request hitting both and needing 2 more
    # blocks needs 4 free blocks in all: reviving the hits uses up the evictable pool.
    bm = BlockManager(num_blocks=3, block_size=4)
    a = seq("a", list(range(9)))
    admit(bm, a)
    bm.free(a)
    b = seq("b", list(range(8)) + list(range(100, 105)))  # 13 tokens -> 4 blocks
    assert bm.get_computed_prefix(b) == 8
    assert bm.num_blocks_to_allocate(b, 5, 8) == 4
    assert not bm.can_allocate(b, 5, 8)
    assert bm.can_allocate(b, 4, 8)  # a first chunk that stays within 3 blocks


def test_duplicate_block_computed_concurrently_is_not_cached_twice():
    bm = BlockManager(num_blocks=8, block_size=4)
    a, b = seq("a", list(range(5))), seq("b", list(range(5)))
    for s in (a, b):  # both admitted before either computed anything: no hit possible
        bm.allocate_slots(s, 5, bm.get_computed_prefix(s))
    for s in (a, b):
        s.num_computed_tokens = 5
        bm.cache_full_blocks(s)
    assert bm.blocks[a.block_table[0]].block_hash is not None
    assert bm.blocks[b.block_table[0]].block_hash is None
    bm.free(b)
    bm.free(a)
    assert bm.num_cached_free_blocks == 1 and bm.num_free_blocks == 8


def test_prefix_caching_disabled_never_hits():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    admit(bm, seq("a", list(range(9))))
    assert bm.get_computed_prefix(seq("b", list(range(9)))) == 0
    assert all(block.block_hash is None for block in bm.blocks)
    assert bm.prefix_cache_queries == 0


def test_rollback_releases_blocks_past_the_new_end():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    s = seq("a", list(range(10)))
    compute(bm, s)
    third = s.block_table[2]
    bm.rollback(s, 3)  # 10 -> 7 computed: positions 0..6 in 2 blocks
    assert s.num_computed_tokens == 7 and len(s.block_table) == 2
    assert bm.ref_count(third) == 0 and bm.is_free(third)
    bm.rollback(s, 0)
    assert len(s.block_table) == 2
    with pytest.raises(ValueError):
        bm.rollback(s, 8)


def test_rollback_refuses_to_touch_cached_blocks():
    bm = BlockManager(num_blocks=8, block_size=4)
    s = seq("a", list(range(10)))
    compute(bm, s)  # blocks 0 and 1 are registered
    bm.rollback(s, 2)  # 10 -> 8: only the unhashed third block
    assert len(s.block_table) == 2
    with pytest.raises(ValueError):
        bm.rollback(s, 1)


def test_sequence_token_slices_span_prompt_and_output():
    s = seq("a", [1, 2, 3])
    s.output_token_ids.extend([4, 5])
    assert s.token_ids(0, 2) == [1, 2]
    assert s.token_ids(2, 5) == [3, 4, 5]
    assert s.token_ids(3, 5) == [4, 5]
    assert s.all_token_ids == [1, 2, 3, 4, 5]
