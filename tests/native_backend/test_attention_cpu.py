"""The "cpu" attention backend (C paged decode kernel for short queries, C prefill kernel for long
chunks, the reference's SDPA for head sizes the prefill kernel does not take) against the dense
computation and the reference, on ragged lengths, GQA ratios, block sizes, head sizes, short
multi-token chunks, chunks after a cached prefix and rows long enough to be split into chunks."""

from __future__ import annotations

import pytest
import torch

from tests.support.data.attention_cases import dense, make_case
from native_backend.kernels import cpu_kernels
from native_backend.model.attention import cpu, get_attention_backend, reference
from native_backend.model.kv_cache import KVLayer

torch.set_num_threads(2)
pytestmark = pytest.mark.usefixtures("c_kernels")  # skips only where the CPU cannot run them (tests/support/checks/c_kernels.py)

CASES = {
    "decode-ragged": [(1, 1), (15, 1), (16, 1), (17, 1), (31, 1), (32, 1), (33, 1), (100, 1)],
    "decode-one-long": [(1000, 1)],  # one row cut into several work items, merged
    "short-chunks": [(40, 4), (17, 8), (9, 2), (100, 1), (3, 3)],  # q_len <= 8: every row in the kernel
    "mixed": [(33, 1), (20, 20), (64, 1), (50, 18), (17, 3), (1, 1), (16, 16), (30, 9)],  # 9: the SDPA path
    "prefill-only": [(40, 40), (25, 12)],
}
GQA = [(3, 3), (1, 9), (2, 1), (4, 2)]  # (num_kv_heads, group): SmolLM2 is (3, 3)


def test_kernels_are_available_where_the_platform_supports_them():
    assert cpu_kernels.available(), cpu_kernels.unavailable_reason()
    assert get_attention_backend("cpu").name == "cpu"


@pytest.mark.usefixtures("kernel_path")  # once per CPU kernel path (AVX2, AVX-512)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("num_kv_heads,group", GQA)
def test_cpu_backend_matches_dense_and_reference(case, num_kv_heads, group):
    q, ks, vs, cache_k, cache_v, md = make_case(CASES[case], num_kv_heads=num_kv_heads, group=group)
    got = cpu.paged_attention(q, KVLayer.of(cache_k, cache_v), md, 0.125)
    torch.testing.assert_close(got, dense(q, ks, vs, md, 0.125), atol=1e-5, rtol=1e-5)
    md.scratch.clear()
    torch.testing.assert_close(got, reference.paged_attention(q, KVLayer.of(cache_k, cache_v), md, 0.125), atol=1e-5, rtol=1e-5)


@pytest.mark.usefixtures("kernel_path")  # once per CPU kernel path (AVX2, AVX-512)
@pytest.mark.parametrize("block_size", [1, 3, 16, 32])
@pytest.mark.parametrize("head_dim", [8, 24, 64, 128])
def test_block_and_head_sizes(block_size, head_dim):
    seqs = [(1, 1), (block_size, 1), (block_size + 1, 1), (5 * block_size + 2, 1), (2 * block_size + 3, 4)]
    q, ks, vs, cache_k, cache_v, md = make_case(seqs, num_kv_heads=2, group=3, head_dim=head_dim, block_size=block_size)
    got = cpu.paged_attention(q, KVLayer.of(cache_k, cache_v), md, head_dim**-0.5)
    torch.testing.assert_close(got, dense(q, ks, vs, md, head_dim**-0.5), atol=1e-5, rtol=1e-5)


@pytest.mark.usefixtures("kernel_path")  # once per CPU kernel path (AVX2, AVX-512)
@pytest.mark.parametrize("chunk_blocks", [1, 2, 7, 32, 1000])
def test_work_split_into_chunks_merges_exactly(chunk_blocks):
    """However a row's keys are cut into work items, the merged softmax is the same."""
    seqs = [(700, 1), (33, 1), (161, 1), (5, 1)]
    q, ks, vs, cache_k, cache_v, md = make_case(seqs, num_kv_heads=3, group=3)
    rows = torch.arange(len(seqs))
    keys = torch.tensor([ctx for ctx, _ in seqs])
    got = cpu_kernels.paged_decode(q, cache_k, cache_v, md.block_tables, rows, keys, 0.125, chunk_blocks=chunk_blocks)
    torch.testing.assert_close(got, dense(q, ks, vs, md, 0.125), atol=1e-5, rtol=1e-5)


@pytest.mark.usefixtures("kernel_path")  # once per CPU kernel path (AVX2, AVX-512)
def test_large_scores_do_not_overflow():
    """exp() is taken after subtracting each chunk's max: scores in the hundreds stay finite."""
    q, ks, vs, cache_k, cache_v, md = make_case([(300, 1), (40, 1)], num_kv_heads=1, group=2)
    q = q * 40
    got = cpu.paged_attention(q, KVLayer.of(cache_k, cache_v), md, 1.0)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, dense(q, ks, vs, md, 1.0), atol=1e-4, rtol=1e-4)


def test_half_precision_cache_falls_back_to_the_reference():
    seqs = [(40, 1), (17, 1), (20, 6)]
    q, ks, vs, cache_k, cache_v, md = make_case(seqs, num_kv_heads=3, group=3, cache_dtype=torch.bfloat16)
    got = cpu.paged_attention(q, KVLayer.of(cache_k, cache_v), md, 0.125)
    md.scratch.clear()
    torch.testing.assert_close(got, reference.paged_attention(q, KVLayer.of(cache_k, cache_v), md, 0.125), atol=0, rtol=0)


def test_plan_is_built_once_per_step():
    q, _, _, cache_k, cache_v, md = make_case([(33, 1), (20, 20), (64, 1)], num_kv_heads=3, group=3)
    cpu.paged_attention(q, KVLayer.of(cache_k, cache_v), md, 0.125)
    plan = md.scratch["cpu_plan"]
    cpu.paged_attention(q, KVLayer.of(cache_k, cache_v), md, 0.125)
    assert md.scratch["cpu_plan"] is plan
    assert plan.short_rows.tolist() == [0, 21] and plan.row_keys.tolist() == [33, 64] and len(plan.prefills) == 1


def test_write_kv_puts_each_row_in_its_slot_like_the_reference():
    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(5, 3, 8, generator=g), torch.randn(5, 3, 8, generator=g)
    slots = torch.tensor([17, 0, 9, 31, 4])
    ours = [torch.zeros(8, 4, 3, 8) for _ in range(2)]
    ref = [torch.zeros(8, 4, 3, 8) for _ in range(2)]
    cpu.write_kv(k, v, KVLayer.of(*ours), slots)
    reference.write_kv(k, v, KVLayer.of(*ref), slots)
    assert torch.equal(ours[0], ref[0]) and torch.equal(ours[1], ref[1])
    assert torch.equal(ours[0].view(-1, 3, 8)[31], k[3]) and torch.equal(ours[1].view(-1, 3, 8)[0], v[1])
    with pytest.raises(ValueError, match="one slot per new token"):
        cpu_kernels.write_kv(k, v, *ours, slots[:4])


# ------------------------------------------------------------------------------ prefill kernel


@pytest.mark.parametrize("num_kv_heads,group", GQA + [(1, 8)])  # group 9 and 8: heads split over items
@pytest.mark.parametrize("seqs", [[(600, 600)], [(520, 200), (47, 47)], [(31, 30), (16, 9), (2, 2)]],
                         ids=["long-prompt", "after-prefix", "tile-edges"])
@pytest.mark.usefixtures("kernel_path")  # once per CPU kernel path (AVX2, AVX-512)
def test_prefill_kernel_matches_dense(seqs, num_kv_heads, group):
    q, ks, vs, cache_k, cache_v, md = make_case(seqs, num_kv_heads=num_kv_heads, group=group)
    got = cpu.paged_attention(q, KVLayer.of(cache_k, cache_v), md, 0.125)
    torch.testing.assert_close(got, dense(q, ks, vs, md, 0.125), atol=1e-5, rtol=1e-5)


@pytest.mark.usefixtures("kernel_path")  # once per CPU kernel path (AVX2, AVX-512)
@pytest.mark.parametrize("head_dim", [32, 96, 256])
@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_prefill_kernel_head_and_block_sizes(head_dim, block_size):
    seqs = [(3 * block_size + 20, 3 * block_size + 20), (40, 25)]
    q, ks, vs, cache_k, cache_v, md = make_case(seqs, num_kv_heads=2, group=3, head_dim=head_dim,
                                                block_size=block_size)
    got = cpu.paged_attention(q, KVLayer.of(cache_k, cache_v), md, head_dim**-0.5)
    torch.testing.assert_close(got, dense(q, ks, vs, md, head_dim**-0.5), atol=1e-5, rtol=1e-5)


@pytest.mark.usefixtures("kernel_path")  # once per CPU kernel path (AVX2, AVX-512)
def test_prefill_kernel_is_stable_with_large_scores():
    """Scores in the hundreds: the online softmax rescales instead of overflowing."""
    q, ks, vs, cache_k, cache_v, md = make_case([(300, 300)], num_kv_heads=3, group=3, seed=3)
    q = q * 40
    got = cpu.paged_attention(q, KVLayer.of(cache_k, cache_v), md, 0.125)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, dense(q, ks, vs, md, 0.125), atol=1e-4, rtol=1e-4)


def test_prefill_kernel_refuses_what_it_cannot_read():
    q, cache = torch.randn(4, 6, 64), torch.zeros(8, 4, 2, 64)
    ids = torch.arange(2)
    with pytest.raises(ValueError, match="head_dim 24"):
        cpu_kernels.prefill_attention(torch.randn(4, 6, 24), torch.zeros(8, 4, 2, 24), torch.zeros(8, 4, 2, 24),
                                      ids, 8, 1.0)
    with pytest.raises(ValueError, match="2 blocks"):
        cpu_kernels.prefill_attention(q, cache, cache, ids, 9, 1.0)  # 9 positions need 3 blocks of 4
    with pytest.raises(ValueError, match="4 queries, 3 positions"):
        cpu_kernels.prefill_attention(q, cache, cache, ids, 3, 1.0)
    with pytest.raises(ValueError, match="int64"):
        cpu_kernels.prefill_attention(q, cache, cache, ids.int(), 8, 1.0)
    assert cpu_kernels.prefill_attention(q, cache, cache, ids, 8, 1.0).shape == q.shape
