"""The fused layer ops (csrc/layer_ops.c through layers.cpu_ops.KernelOps) against torch's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from native_backend.config.model import ModelConfig
from native_backend.kernels import cpu_kernels
from native_backend.model.layers.cpu_ops import KERNEL_OPS
from native_backend.model.layers.norm import RMSNorm
from native_backend.model.layers.ops import TORCH_OPS
from native_backend.model.layers.rotary import RotaryEmbedding, apply_rope

torch.set_num_threads(2)
pytestmark = pytest.mark.usefixtures("c_kernels")  # skips only where the CPU cannot run them (tests/support/checks/c_kernels.py)


def randn(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.mark.usefixtures("kernel_path")  # once per CPU kernel path (AVX2, AVX-512)
@pytest.mark.parametrize("m", [1, 7, 40])  # 40: rows spread over the threads
@pytest.mark.parametrize("d", [8, 24, 576])
def test_add_rms_norm_adds_in_place_and_normalises(m, d):
    residual, delta, weight = randn(m, d, seed=1), randn(m, d, seed=2, scale=3.0), randn(d, seed=3)
    expected_sum = residual + delta
    out = cpu_kernels.add_rms_norm_(residual, delta, weight, 1e-5)
    torch.testing.assert_close(residual, expected_sum, rtol=0, atol=0)
    torch.testing.assert_close(out, F.rms_norm(expected_sum, (d,), weight, 1e-5), rtol=1e-5, atol=1e-5)
    alone = cpu_kernels.add_rms_norm_(residual, None, weight, 1e-5)  # the norm only
    torch.testing.assert_close(alone, out, rtol=0, atol=0)
    torch.testing.assert_close(residual, expected_sum, rtol=0, atol=0)


def test_add_rms_norm_of_zeros_is_zero_not_nan():
    out = cpu_kernels.add_rms_norm_(torch.zeros(2, 16), None, torch.ones(16), 1e-6)
    assert torch.equal(out, torch.zeros(2, 16))


def rope_tables(head_dim: int, max_pos: int = 300) -> RotaryEmbedding:
    return RotaryEmbedding(ModelConfig(
        vocab_size=10, hidden_size=head_dim * 4, intermediate_size=8, num_layers=1, num_heads=4, num_kv_heads=2,
        head_dim=head_dim, max_position_embeddings=max_pos, rope_theta=10000.0))


@pytest.mark.usefixtures("kernel_path")  # once per CPU kernel path (AVX2, AVX-512)
@pytest.mark.parametrize("head_dim", [16, 64, 128])
@pytest.mark.parametrize("n", [1, 5, 40])
def test_rope_matches_rotate_half(head_dim, n):
    rotary = rope_tables(head_dim)
    positions = torch.randperm(300, generator=torch.Generator().manual_seed(n))[:n]
    q, k = randn(n, 9, head_dim, seed=4), randn(n, 3, head_dim, seed=5)
    cos, sin = rotary(positions)
    want_q, want_k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    cpu_kernels.rope_qk_(q, k, positions, rotary.cos, rotary.sin)
    torch.testing.assert_close(q, want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k, want_k, rtol=1e-5, atol=1e-5)


@pytest.mark.usefixtures("kernel_path")  # once per CPU kernel path (AVX2, AVX-512)
@pytest.mark.parametrize("m,n", [(1, 8), (3, 1536), (40, 112)])
def test_silu_mul_matches_torch_over_the_whole_range(m, n):
    gate = randn(m, n, seed=6, scale=30.0)  # far into both tails, where exp overflows if done naively
    gate[0, :8] = torch.tensor([0.0, -0.0, 88.0, -88.0, 1e-30, -1e-30, 200.0, -200.0])
    up = randn(m, n, seed=7)
    want = F.silu(gate) * up
    got = cpu_kernels.silu_mul_(gate.clone(), up)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("call,match", [
    (lambda: cpu_kernels.add_rms_norm_(torch.randn(2, 12), None, torch.ones(12), 1e-6), "multiple of 8"),
    (lambda: cpu_kernels.add_rms_norm_(torch.randn(16, 2).t(), None, torch.ones(16), 1e-6), "contiguous"),
    (lambda: cpu_kernels.add_rms_norm_(torch.randn(2, 8), torch.randn(3, 8), torch.ones(8), 1e-6), "delta"),
    (lambda: cpu_kernels.add_rms_norm_(torch.randn(2, 8).double(), None, torch.ones(8), 1e-6), "float32"),
    (lambda: cpu_kernels.rope_qk_(torch.randn(2, 4, 8), torch.randn(2, 2, 8), torch.arange(2),
                                  torch.randn(9, 4), torch.randn(9, 4)), "multiple of 16"),
    (lambda: cpu_kernels.rope_qk_(torch.randn(2, 4, 16), torch.randn(2, 2, 16), torch.arange(3),
                                  torch.randn(9, 8), torch.randn(9, 8)), "one position per token"),
    (lambda: cpu_kernels.rope_qk_(torch.randn(2, 4, 16), torch.randn(2, 2, 16), torch.arange(2).int(),
                                  torch.randn(9, 8), torch.randn(9, 8)), "int64"),
    (lambda: cpu_kernels.silu_mul_(torch.randn(2, 8), torch.randn(2, 16)), "alike"),
    (lambda: cpu_kernels.silu_mul_(torch.randn(2, 12), torch.randn(2, 12)), "multiple of 8"),
])
def test_kernels_refuse_what_they_cannot_read(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# ------------------------------------------------------------------------------ KernelOps


@pytest.mark.usefixtures("kernel_path")  # once per CPU kernel path (AVX2, AVX-512)
@torch.inference_mode()
def test_kernel_ops_agree_with_torch_ops_through_a_stream():
    """Two layers' worth of the stream: embeddings -> norm -> add+norm -> ..., as the model calls it."""
    norm = RMSNorm(64, 1e-5)
    norm.weight.copy_(randn(64, seed=8))
    rotary = rope_tables(16)
    positions = torch.tensor([0, 5, 6, 299])
    emb = randn(4, 64, seed=9)
    results = []
    for ops in (TORCH_OPS, KERNEL_OPS):
        residual, x = ops.add_rms_norm(None, emb.clone(), norm)
        for seed in (10, 11):
            residual, x = ops.add_rms_norm(residual, randn(4, 64, seed=seed), norm)
        tables = ops.rope_tables(rotary, positions)
        q, k = ops.rope(x.view(4, 4, 16).clone(), x[:, :32].reshape(4, 2, 16).clone(), tables)
        gated = ops.silu_mul(randn(4, 112, seed=12), randn(4, 112, seed=13))
        results.append((residual, x, q, k, gated))
    for want, got in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_kernel_ops_fall_back_to_torch_where_kernels_cannot_go():
    norm = RMSNorm(12, 1e-5)  # 12: not a multiple of 8
    x = randn(3, 12, seed=14)
    with torch.inference_mode():
        torch.testing.assert_close(KERNEL_OPS.add_rms_norm(x, x, norm)[1], TORCH_OPS.add_rms_norm(x, x, norm)[1])
        gate64, up64 = randn(2, 16, seed=15).double(), randn(2, 16, seed=16).double()
        assert KERNEL_OPS.silu_mul(gate64.clone(), up64).dtype == torch.float64
    # autograd on: nothing may be written in place
    leaf = randn(3, 16, seed=17).requires_grad_()
    norm16 = RMSNorm(16, 1e-5)
    residual, out = KERNEL_OPS.add_rms_norm(leaf * 1.0, randn(3, 16, seed=18), norm16)
    out.sum().backward()
    assert leaf.grad is not None
    rotary = rope_tables(16)
    q = randn(2, 4, 16, seed=19).requires_grad_()
    rq, _ = KERNEL_OPS.rope(q, randn(2, 2, 16, seed=20), KERNEL_OPS.rope_tables(rotary, torch.arange(2)))
    rq.sum().backward()
    assert q.grad is not None


def test_positions_outside_the_rotary_tables_are_refused_not_read():
    rotary = rope_tables(16, max_pos=8)
    with pytest.raises(IndexError, match="0 .. 7"):
        KERNEL_OPS.rope_tables(rotary, torch.tensor([3, 8]))
    with pytest.raises(IndexError):
        KERNEL_OPS.rope_tables(rotary, torch.tensor([-1]))
