"""The reference backend's batched CPU path (one padded decode batch per step, 4-D SDPA per
prefill sequence, a per-step plan shared by all layers) against the plain per-sequence loop and a
dense computation, on ragged lengths, several GQA ratios and block boundaries."""

from __future__ import annotations

import pytest
import torch

from tests.support.data.attention_cases import dense, make_case
from native_backend.model.attention import reference
from native_backend.model.kv_cache import KVLayer

torch.set_num_threads(1)


CASES = {
    # decode only, contexts on both sides of block boundaries (block_size 16)
    "decode-ragged": [(1, 1), (15, 1), (16, 1), (17, 1), (31, 1), (32, 1), (33, 1), (100, 1)],
    "decode-equal": [(48, 1)] * 4,  # no padding: the unmasked path
    "decode-one": [(300, 1)],
    "prefill-one": [(40, 40)],  # a fresh prompt alone: is_causal, output returned as is
    "chunk-one": [(40, 7)],  # a chunk after a cached prefix: bottom-right causal mask
    "mixed": [(33, 1), (20, 20), (64, 1), (50, 18), (17, 3), (1, 1), (16, 16)],
    # decodes of very different lengths: several length groups, rows scattered back in order
    "decode-groups": [(300, 1), (20, 1), (150, 1), (9, 1), (260, 1), (70, 1), (33, 1), (5, 1), (140, 1), (64, 1)],
    "mixed-groups": [(300, 1), (20, 1), (40, 12), (150, 1), (9, 1), (260, 1), (70, 1), (33, 1), (5, 1)],
}
GQA = [(3, 3), (1, 9), (2, 1), (4, 2)]  # (num_kv_heads, group): SmolLM2 is (3, 3)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("num_kv_heads,group", GQA)
def test_batched_matches_per_sequence_and_dense(case, num_kv_heads, group):
    q, ks, vs, cache_k, cache_v, md = make_case(CASES[case], num_kv_heads=num_kv_heads, group=group)
    scale = 64**-0.5
    got = reference.paged_attention(q, KVLayer.of(cache_k, cache_v), md, scale)
    spec = reference.paged_attention_per_sequence(q, KVLayer.of(cache_k, cache_v), md, scale)
    want = dense(q, ks, vs, md, scale)
    assert got.shape == q.shape
    torch.testing.assert_close(spec, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size", [1, 4, 5])
def test_small_and_odd_block_sizes(block_size):
    seqs = [(9, 1), (8, 1), (1, 1), (13, 4), (6, 6)]
    q, ks, vs, cache_k, cache_v, md = make_case(seqs, num_kv_heads=2, group=3, head_dim=16, block_size=block_size)
    got = reference.paged_attention(q, KVLayer.of(cache_k, cache_v), md, 0.25)
    torch.testing.assert_close(got, dense(q, ks, vs, md, 0.25), atol=1e-5, rtol=1e-5)


def test_plan_is_built_once_and_shared_by_layers():
    """Two layers (two caches) with one metadata: one plan, the gather workspace reused, and an
    earlier layer's output is not disturbed by the next layer's gather."""
    seqs = [(33, 1), (70, 1), (5, 1)]
    q1, ks1, vs1, ck1, cv1, md = make_case(seqs, num_kv_heads=3, group=3, seed=1)
    q2, ks2, vs2, _, _, _ = make_case(seqs, num_kv_heads=3, group=3, seed=2)
    # Layer 2's cache, laid out by *this* step's block tables.
    ck2, cv2 = torch.zeros_like(ck1), torch.zeros_like(cv1)
    for s, (k, v) in enumerate(zip(ks2, vs2)):
        for pos in range(k.shape[0]):
            b = md.block_tables[s, pos // md.block_size]
            ck2[b, pos % md.block_size], cv2[b, pos % md.block_size] = k[pos], v[pos]
    out1 = reference.paged_attention(q1, KVLayer.of(ck1, cv1), md, 0.125)
    plan = md.scratch["reference_plan"]
    first_out = out1.clone()
    out2 = reference.paged_attention(q2, KVLayer.of(ck2, cv2), md, 0.125)
    assert md.scratch["reference_plan"] is plan
    torch.testing.assert_close(out1, first_out, atol=0, rtol=0)
    torch.testing.assert_close(out1, dense(q1, ks1, vs1, md, 0.125), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out2, dense(q2, ks2, vs2, md, 0.125), atol=1e-5, rtol=1e-5)


def test_half_precision_cache_with_fp32_queries():
    seqs = [(20, 1), (37, 1), (12, 5)]
    q, ks, vs, cache_k, cache_v, md = make_case(seqs, num_kv_heads=2, group=2, head_dim=32, cache_dtype=torch.bfloat16)
    got = reference.paged_attention(q, KVLayer.of(cache_k, cache_v), md, 32**-0.5)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, dense(q, ks, vs, md, 32**-0.5), atol=1e-4, rtol=1e-4)


def test_length_groups_bound_padding():
    ctx = [300, 20, 150, 9, 260, 70, 33, 5, 140, 64, 151, 290, 12]
    groups = reference._length_groups(list(range(len(ctx))), ctx)
    assert sorted(s for g in groups for s in g) == list(range(len(ctx)))
    assert all(g == sorted(g) for g in groups)
    assert groups == [[0, 4, 10, 11], [2, 5, 8, 9], [1, 3, 6, 7, 12]]  # 300..151 | 150..64 | 33..5
    padded = sum(len(g) * max(ctx[s] for s in g) for g in groups)
    assert padded < 0.6 * len(ctx) * max(ctx)
    # Few sequences, or similar lengths: one group in batch order.
    assert reference._length_groups([0, 1, 2], [300, 10, 40]) == [[0, 1, 2]]
    assert reference._length_groups([0, 1, 2, 3, 4, 5, 6], [100, 60, 99, 51, 80, 52, 70]) == [list(range(7))]
    assert reference._length_groups([], []) == []
