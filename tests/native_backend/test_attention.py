"""Paged attention: the torch reference against a naive dense computation, and the Triton kernels
against the reference under TRITON_INTERPRET=1 (in a subprocess, so the interpreter setting never
leaks into this test process; run this file as a script to see those checks directly).
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

from native_backend.model.attention import get_attention_backend
from native_backend.model.attention.metadata import AttentionMetadata
from native_backend.model.kv_cache import KVLayer

torch.set_num_threads(1)
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclass
class Scenario:
    q: torch.Tensor  # (num_tokens, num_heads, head_dim)
    k_new: torch.Tensor  # (num_tokens, num_kv_heads, head_dim): this step's keys
    v_new: torch.Tensor
    k_seqs: list[torch.Tensor]  # per sequence (context_len, num_kv_heads, head_dim): all its keys
    v_seqs: list[torch.Tensor]
    cache_k: torch.Tensor  # holds every cached (pre-step) key already
    cache_v: torch.Tensor
    metadata: AttentionMetadata
    scale: float


def make_scenario(seqs, *, num_kv_heads, group, head_dim=16, block_size=4, num_blocks=40, seed=0) -> Scenario:
    """seqs: (context_len, query_len) per sequence; the first context-query positions are cached."""
    g = torch.Generator().manual_seed(seed)
    free = torch.randperm(num_blocks, generator=g).tolist()  # scrambled physical blocks
    cache_k = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim)
    cache_v = torch.zeros_like(cache_k)
    tables, k_seqs, v_seqs, qs, k_new, v_new = [], [], [], [], [], []
    for ctx, q_len in seqs:
        table = [free.pop() for _ in range(-(-ctx // block_size))]
        k = torch.randn(ctx, num_kv_heads, head_dim, generator=g)
        v = torch.randn(ctx, num_kv_heads, head_dim, generator=g)
        cached = ctx - q_len
        for pos in range(cached):  # write the cached prefix by hand: independent of write_kv
            cache_k[table[pos // block_size], pos % block_size] = k[pos]
            cache_v[table[pos // block_size], pos % block_size] = v[pos]
        tables.append(table)
        k_seqs.append(k)
        v_seqs.append(v)
        k_new.append(k[cached:])
        v_new.append(v[cached:])
        qs.append(torch.randn(q_len, num_kv_heads * group, head_dim, generator=g))
    md = AttentionMetadata.build(
        query_lens=[q for _, q in seqs], context_lens=[c for c, _ in seqs], block_tables=tables, block_size=block_size
    )
    return Scenario(torch.cat(qs), torch.cat(k_new), torch.cat(v_new), k_seqs, v_seqs, cache_k, cache_v, md, head_dim**-0.5)


def naive_attention(s: Scenario) -> torch.Tensor:
    """Dense softmax(q k^T) v per sequence and head, causal by absolute position."""
    outs = []
    starts = s.metadata.query_start_loc.tolist()
    for i, (k, v) in enumerate(zip(s.k_seqs, s.v_seqs)):
        q = s.q[starts[i] : starts[i + 1]]  # (q_len, num_heads, head_dim)
        q_len, ctx, group = q.shape[0], k.shape[0], q.shape[1] // k.shape[1]
        k_full = k.repeat_interleave(group, dim=1)  # (ctx, num_heads, head_dim)
        v_full = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k_full) * s.scale
        q_pos = torch.arange(ctx - q_len, ctx)[:, None]
        scores = scores.masked_fill(torch.arange(ctx)[None, :] > q_pos, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v_full))
    return torch.cat(outs)


def run_backend(name: str, s: Scenario) -> torch.Tensor:
    backend = get_attention_backend("cpu", name)
    cache_k, cache_v = s.cache_k.clone(), s.cache_v.clone()
    backend.write_kv(s.k_new, s.v_new, KVLayer.of(cache_k, cache_v), s.metadata.slot_mapping)
    return backend.paged_attention(s.q, KVLayer.of(cache_k, cache_v), s.metadata, s.scale)


# (context_len, query_len) per sequence. block_size 4: 8 ends on a boundary, 9 starts a block.
CASES = {
    "prefill": [(9, 9), (4, 4), (13, 13)],
    "decode": [(9, 1), (8, 1), (1, 1), (17, 1)],
    "chunked": [(13, 5), (8, 4)],
    "mixed": [(12, 1), (10, 6), (5, 5), (16, 1), (21, 3)],
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("num_kv_heads,group", [(2, 1), (2, 3), (1, 4)])
def test_reference_matches_naive(case, num_kv_heads, group):
    s = make_scenario(CASES[case], num_kv_heads=num_kv_heads, group=group)
    torch.testing.assert_close(run_backend("reference", s), naive_attention(s), atol=1e-5, rtol=1e-5)


def test_write_kv_puts_each_token_in_its_slot():
    s = make_scenario([(6, 6), (3, 2)], num_kv_heads=2, group=1, block_size=4)
    cache_k, cache_v = torch.zeros_like(s.cache_k), torch.zeros_like(s.cache_v)
    get_attention_backend("cpu").write_kv(s.k_new, s.v_new, KVLayer.of(cache_k, cache_v), s.metadata.slot_mapping)
    table = s.metadata.block_tables[1].tolist()
    # Sequence 1 had 1 cached token, so its new tokens are positions 1 and 2: block 0, offsets 1 and 2.
    torch.testing.assert_close(cache_k[table[0], 1:3], s.k_seqs[1][1:3])
    torch.testing.assert_close(cache_v[table[0], 1:3], s.v_seqs[1][1:3])
    assert cache_k[table[0], 0].abs().sum() == 0  # the cached slot was not touched


def test_slot_mapping_follows_block_tables():
    md = AttentionMetadata.build(query_lens=[3, 1], context_lens=[3, 6], block_tables=[[7], [2, 9]], block_size=4)
    #    seq 0: positions 0,1,2 in block 7 -> 28,29,30; seq 1: position 5 -> block 9 offset 1 -> 37
    assert md.slot_mapping.tolist() == [28, 29, 30, 37]
    assert md.query_start_loc.tolist() == [0, 3, 4]


# ------------------------------------------------------------------------------ Triton (interpreted)

TRITON_CASES = [
    # (name, seqs, num_kv_heads, group, block_size)
    ("decode-gqa1", [(9, 1), (16, 1), (1, 1)], 2, 1, 4),
    ("decode-gqa3", [(17, 1), (5, 1)], 1, 3, 16),
    ("prefill-gqa4", [(9, 9), (20, 20)], 1, 4, 16),
    ("chunked-gqa3", [(21, 5), (4, 4)], 1, 3, 4),
    ("mixed-gqa1", [(18, 1), (7, 3)], 2, 1, 8),
]


def run_triton_checks() -> None:
    """Run in a process with TRITON_INTERPRET=1 already in the environment."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    for name, seqs, kv_heads, group, block_size in TRITON_CASES:
        s = make_scenario(seqs, num_kv_heads=kv_heads, group=group, block_size=block_size)
        ref_k, ref_v = s.cache_k.clone(), s.cache_v.clone()
        get_attention_backend("cpu", "reference").write_kv(s.k_new, s.v_new, KVLayer.of(ref_k, ref_v), s.metadata.slot_mapping)
        tri_k, tri_v = s.cache_k.clone(), s.cache_v.clone()
        triton_backend = get_attention_backend("cpu", "triton")
        triton_backend.write_kv(s.k_new, s.v_new, KVLayer.of(tri_k, tri_v), s.metadata.slot_mapping)
        assert torch.equal(tri_k, ref_k) and torch.equal(tri_v, ref_v), f"{name}: write_kv differs"
        expected = get_attention_backend("cpu", "reference").paged_attention(s.q, KVLayer.of(ref_k, ref_v), s.metadata, s.scale)
        got = triton_backend.paged_attention(s.q, KVLayer.of(tri_k, tri_v), s.metadata, s.scale)
        err = (got - expected).abs().max().item()
        assert err < 1e-4, f"{name}: max abs error {err}"
        print(f"{name}: ok (max abs error {err:.2e})")


def test_triton_kernels_match_reference_under_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": REPO_ROOT}
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__)], env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count(": ok") == len(TRITON_CASES), proc.stdout


if __name__ == "__main__":
    run_triton_checks()
