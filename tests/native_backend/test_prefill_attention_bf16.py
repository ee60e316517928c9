"""bf16 prefill attention (`prefill_attention`, layers/prefill_attention.py): the AVX512_BF16
kernel against the dense float32 answer within bf16's rounding and against a dense computation on
bf16-rounded operands more tightly; decode rows and short chunks keep the float32 kernels bit for
bit; fp8 and int8 caches; the setting's resolution, and the AVX2 path that has no such kernel."""

from __future__ import annotations

import pytest
import torch

from tests.support.checks import cpu_flags
from tests.support.data.attention_cases import dense, make_case
from native_backend.kernels import cpu_kernels
from native_backend.model.attention import cpu, get_attention_backend, reference
from native_backend.model.kv_cache import KVLayer
from native_backend.model.layers import prefill_attention

pytestmark = pytest.mark.usefixtures("c_kernels")  # skips only where the CPU cannot run them
# Q, K and V rounded to bf16 (2^-9 relative each) move a score by ~|q||k| 2^-8; the probabilities
# are rounded once more. With unit-normal q/k/v and scale 1/sqrt(head_dim) the outputs (|o| < ~2)
# move by up to ~1e-2 (measured: 1.3e-2 at most over the GQA cases below).
ATOL_VS_FP32 = 4e-2
# Against the same products on bf16-rounded operands, only the probabilities' rounding and the
# order of the sums remain (measured: 3.3e-3 at most).
ATOL_VS_ROUNDED = 1e-2
GQA = [(3, 3), (1, 9), (2, 4), (1, 8)]  # (KV heads, group): SmolLM2's 9/3, MQA, others; 9 and 8 split items


@pytest.fixture
def bf16_kernel():
    """Runs where the tests' own read of /proc/cpuinfo shows AVX-512 and AVX512_BF16 (a failure
    elsewhere where CI sets KVGATE_REQUIRE_BF16_ATTENTION); there the engine must agree."""
    cpu_flags.need(cpu_flags.BF16_ATTENTION)
    problem = cpu_kernels.bf16_prefill_problem()
    if problem:
        pytest.fail(f"/proc/cpuinfo shows AVX512_BF16 but the engine has no bf16 prefill attention: {problem}",
                    pytrace=False)


def rounded(tensors):
    return [t.bfloat16().float() for t in tensors]


def bf16_attention(q, layer, md, scale):
    return get_attention_backend("cpu", "cpu", prefill_bf16=True).paged_attention(q, layer, md, scale)


@pytest.mark.usefixtures("bf16_kernel")
@pytest.mark.parametrize("num_kv_heads,group", GQA)
@pytest.mark.parametrize("seqs", [[(600, 600)], [(520, 200), (147, 147)], [(95, 33), (64, 9), (300, 71)]],
                         ids=["long-prompt", "after-prefix", "tile-edges"])
def test_bf16_prefill_is_dense_attention_within_bf16_rounding(seqs, num_kv_heads, group):
    q, ks, vs, cache_k, cache_v, md = make_case(seqs, num_kv_heads=num_kv_heads, group=group)
    got = bf16_attention(q, KVLayer.of(cache_k, cache_v), md, 0.125)
    exact = dense(q, ks, vs, md, 0.125)
    assert not torch.equal(got, exact)
    torch.testing.assert_close(got, exact, atol=ATOL_VS_FP32, rtol=0)
    q16, ks16, vs16 = rounded([q]) + [rounded(ks), rounded(vs)]
    torch.testing.assert_close(got, dense(q16, ks16, vs16, md, 0.125), atol=ATOL_VS_ROUNDED, rtol=0)


@pytest.mark.usefixtures("bf16_kernel")
@pytest.mark.parametrize("head_dim", [32, 96, 256])
@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_bf16_prefill_head_and_block_sizes(head_dim, block_size):
    seqs = [(3 * block_size + 90, 3 * block_size + 90), (140, 70)]
    q, ks, vs, cache_k, cache_v, md = make_case(seqs, num_kv_heads=2, group=3, head_dim=head_dim,
                                                block_size=block_size)
    got = bf16_attention(q, KVLayer.of(cache_k, cache_v), md, head_dim**-0.5)
    torch.testing.assert_close(got, dense(q, ks, vs, md, head_dim**-0.5), atol=ATOL_VS_FP32, rtol=0)


@pytest.mark.usefixtures("bf16_kernel")
def test_bf16_prefill_is_stable_with_large_scores():
    """Scores in the hundreds: the online softmax rescales instead of overflowing."""
    q, ks, vs, cache_k, cache_v, md = make_case([(300, 300)], num_kv_heads=3, group=3, seed=3)
    q = q * 40
    got = bf16_attention(q, KVLayer.of(cache_k, cache_v), md, 0.125)
    assert torch.isfinite(got).all()
    q16, ks16, vs16 = rounded([q]) + [rounded(ks), rounded(vs)]
    torch.testing.assert_close(got, dense(q16, ks16, vs16, md, 0.125), atol=ATOL_VS_ROUNDED, rtol=0)


@pytest.mark.usefixtures("bf16_kernel")
def test_decode_rows_and_small_steps_keep_the_float32_kernels_bit_for_bit():
    seqs = [(40, 1), (33, 8), (300, 200)]
    q, ks, vs, cache_k, cache_v, md = make_case(seqs, num_kv_heads=3, group=3)
    layer = KVLayer.of(cache_k, cache_v)
    fp32, got = cpu.paged_attention(q, layer, md, 0.125), bf16_attention(q, layer, md, 0.125)
    assert torch.equal(got[:9], fp32[:9])  # the decode row and the 8-token chunk: the decode kernel
    assert not torch.equal(got[9:], fp32[9:])
    small = [(90, 54), (40, 1), (33, 8)]  # 63 rows: under BF16_MIN_ROWS, the float32 prefill kernel too
    assert cpu.BF16_MIN_ROWS == 64
    q, ks, vs, cache_k, cache_v, md = make_case(small, num_kv_heads=3, group=3)
    layer = KVLayer.of(cache_k, cache_v)
    assert torch.equal(bf16_attention(q, layer, md, 0.125), cpu.paged_attention(q, layer, md, 0.125))


@pytest.mark.usefixtures("bf16_kernel")
@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3", "fp8_e5m2"])
def test_quantized_caches_are_dequantized_then_attended_in_bf16(kv_dtype):
    """The chunk's blocks dequantized as the float32 path reads them: against the reference over the
    same stored bytes."""
    q, ks, vs, cache_k, _, md = make_case([(250, 250)], num_kv_heads=3, group=3)
    layer = KVLayer.allocate(num_blocks=cache_k.shape[0], block_size=16, num_kv_heads=3, head_dim=64, dtype=kv_dtype)
    cpu.write_kv(ks[0], vs[0], layer, md.slot_mapping)
    got = bf16_attention(q, layer, md, 0.125)
    torch.testing.assert_close(got, reference.paged_attention(q, layer, md, 0.125), atol=ATOL_VS_FP32, rtol=0)


# ------------------------------------------------------------------------------ the setting


CPU = torch.device("cpu")


def resolve(setting, bf16_matmuls=True, device=CPU, dtype=torch.float32):
    return prefill_attention.resolve(setting, device=device, dtype=dtype, bf16_matmuls=bf16_matmuls)


def test_explicit_settings_other_devices_and_dtypes(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "bf16_prefill_problem", lambda: None)
    assert resolve("fp32") == (False, "prefill attention fp32 (prefill_attention: fp32)")
    assert resolve("bf16", bf16_matmuls=False) == (True, "prefill attention bf16 (prefill_attention: bf16)")
    assert resolve("bf16", device=torch.device("cuda")) == (False, "")
    assert resolve("auto", dtype=torch.bfloat16) == (False, "")
    with pytest.raises(ValueError, match="prefill_attention: 'fp16'"):
        resolve("fp16")
    monkeypatch.setattr(cpu_kernels, "bf16_prefill_problem", lambda: "the CPU has no AVX512_BF16")
    assert resolve("bf16") == (False, "prefill attention fp32 (prefill_attention: bf16, but the CPU has no "
                                      "AVX512_BF16)")


def test_auto_follows_the_prefill_matmuls_the_cpu_and_the_probe(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "bf16_prefill_problem", lambda: None)
    assert resolve("auto", bf16_matmuls=False) == (False, "prefill attention fp32 (auto: prefill matmuls fp32)")
    monkeypatch.setattr(prefill_attention, "probe_speedup", lambda: 3.0)
    bf16, note = resolve("auto")
    assert bf16 and note.startswith("prefill attention bf16 (auto: AVX512_BF16, bf16 3.0x fp32 at 256 queries")
    monkeypatch.setattr(prefill_attention, "probe_speedup", lambda: 1.2)
    assert not resolve("auto")[0]
    monkeypatch.setattr(cpu_kernels, "bf16_prefill_problem", lambda: "the CPU has no AVX512_BF16")
    assert resolve("auto") == (False, "prefill attention fp32 (auto: the CPU has no AVX512_BF16)")


@pytest.mark.usefixtures("bf16_kernel")
def test_the_probe_times_real_kernels():
    prefill_attention.probe_speedup.cache_clear()
    assert prefill_attention.probe_speedup() > 0


def test_the_avx2_path_has_no_bf16_kernel_and_says_so(monkeypatch):
    """KVGATE_CPU_ISA=avx2 (the floor): the setting falls back to float32, naming the path, and
    the entry point refuses rather than compute."""
    monkeypatch.setenv("KVGATE_CPU_ISA", "avx2")
    cpu_kernels.reset_choice()
    try:
        assert cpu_kernels.path().name == "avx2"
        problem = cpu_kernels.bf16_prefill_problem()
        assert problem == "the avx2 kernel path has no bf16 attention: it needs the avx512 path"
        assert resolve("bf16") == (False, f"prefill attention fp32 (prefill_attention: bf16, but {problem})")
        q, cache = torch.randn(4, 6, 64), torch.zeros(8, 4, 2, 64)
        with pytest.raises(RuntimeError, match="no AVX512_BF16"):
            cpu_kernels.prefill_attention(q, cache, cache, torch.arange(2), 8, 1.0, bf16=True)
    finally:
        cpu_kernels.reset_choice()
