"""GGUF's Q4_0 / Q4_1 run by the int4 method as stored: the blocks repacked (never made float) hold
the numbers gguf's own dequantizer reads from them; the offset kernel equals its reference; the
default model loaded this way is the dequantized model's logits within rounding, its linears packed,
and the one-call decode step runs it bit-identical to the per-layer path."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize, quantize as gguf_quantize

from native_backend.core.batch import ScheduledChunk, SchedulerOutput
from native_backend.core.sampling_params import SamplingParams
from native_backend.execution.model_runner import ModelRunner
from native_backend.kernels import cpu_kernels
from native_backend.model.kv_cache import KVCache
from native_backend.model.layers.context import LayerContext
from native_backend.model.layers.linear import ColumnParallelLinear, LinearBase, RowParallelLinear
from native_backend.model.layers.rotary import unpermute_rotary_rows
from native_backend.model.layers.sharding import ShardSpec
from native_backend.model.loader import default_gguf_path, load_model
from native_backend.model.quantization import gguf_int4
from native_backend.model.quantization.method import Int4OffsetMethod
from native_backend.model.quantization.reference import dequantize_offset, int4_linear_offset
from tests.support.checks.c_kernels import need_kernels

torch.set_num_threads(2)
pytestmark = pytest.mark.timeout(900)
needs_int4_kernel = pytest.mark.usefixtures("int4_kernel")  # skips only where the CPU cannot run it (tests/support/checks/c_kernels.py)
SMOLLM2_SHAPES = [(576, 576), (576, 192), (576, 1536), (1536, 576)]  # (in, out)
ROWS = [1, 2, 3, 4, 5, 7, 13, 64, 129, 300]
# Every shape with every group that divides its inputs (SmolLM2's 576 takes 32 and 64, not 128).
GROUPED_SHAPES = [(k, n, g) for k, n in SMOLLM2_SHAPES for g in (32, 64, 128) if k % g == 0]


def gen(seed):
    return torch.Generator().manual_seed(seed)


def random_offset_int4(k, n, group, seed):
    q = torch.randint(0, 16, (n, k), generator=gen(seed), dtype=torch.uint8)
    d = (torch.rand(n, k // group, generator=gen(seed + 1)) * 0.02 + 0.001).half()
    off = (torch.randn(n, k // group, generator=gen(seed + 2)) * 0.05).half()
    return gguf_int4.to_int4_layout(q, d, off)


def rel_err(y, ref):
    return float((y - ref).abs().max() / ref.abs().max())


# ------------------------------------------------------------------------------ the kernel


@pytest.mark.usefixtures("kernel_path")  # once per CPU kernel path (AVX2, AVX-512)
@needs_int4_kernel
@pytest.mark.parametrize("k,n,group", GROUPED_SHAPES)
def test_offset_kernel_equals_the_reference(k, n, group):
    p = random_offset_int4(k, n, group, seed=k + n + group)
    bias = torch.randn(n, generator=gen(5))
    for m in ROWS:
        x = torch.randn(m, k, generator=gen(m))
        ref = int4_linear_offset(x, p["qweight"], p["offsets"], p["scales"], bias)
        y = cpu_kernels.int4_linear_off(x, p["qweight"], p["offsets"], p["scales"], bias)
        assert rel_err(y, ref) < 1e-5, (m, k, n, group)


@pytest.mark.usefixtures("kernel_path")  # once per CPU kernel path (AVX2, AVX-512)
@needs_int4_kernel
@pytest.mark.parametrize("code,offset", [(0, 0.0), (15, 0.0), (0, -4.0), (15, -7.5), (15, 2.0)])
def test_offset_extremes(code, offset):
    k, n = 96, 104  # 104: a wide band of 64 columns at decode rows, then 40: a band of one word at the edge
    p = gguf_int4.to_int4_layout(torch.full((n, k), code, dtype=torch.uint8), torch.full((n, k // 32), 0.5).half(),
                                 torch.full((n, k // 32), offset).half())
    for m in (1, 2, 5):
        x = torch.randn(m, k, generator=gen(m))
        expected = x.sum(dim=1, keepdim=True) * (code * 0.5 + offset) * torch.ones(1, n)
        for y in (int4_linear_offset(x, p["qweight"], p["offsets"], p["scales"]),
                  cpu_kernels.int4_linear_off(x, p["qweight"], p["offsets"], p["scales"])):
            torch.testing.assert_close(y, expected, atol=1e-4, rtol=1e-5)


@needs_int4_kernel
def test_offset_kernel_refuses_mismatched_tensors():
    p = random_offset_int4(64, 16, 32, seed=0)
    with pytest.raises(ValueError, match="do not fit"):
        cpu_kernels.int4_linear_off(torch.randn(2, 64), p["qweight"], p["offsets"][:1], p["scales"])
    with pytest.raises(ValueError, match="torch.float16"):
        cpu_kernels.int4_linear_off(torch.randn(2, 64), p["qweight"], p["offsets"].float(), p["scales"])


# ------------------------------------------------------------------------------ repacking vs gguf


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1])
def test_repacked_blocks_hold_what_ggufs_dequantizer_reads(qtype):
    out, k = 48, 160  # 5 blocks a row
    w = np.random.default_rng(int(qtype)).standard_normal((out, k)).astype(np.float32)
    w[3] = 0.0  # an all-zero row: d = 0
    w[7, :32] = np.linspace(-1, 3, 32)  # a block with a large minimum
    raw = gguf_quantize(w, qtype)
    expected = torch.from_numpy(gguf_dequantize(raw, qtype).astype(np.float32))  # (out, k)
    codes, d, off = gguf_int4.rows(raw, qtype.name, out, k)
    torch.testing.assert_close(gguf_int4.dequantize(codes, d, off), expected, atol=1e-6, rtol=1e-6)
    packed = gguf_int4.repack(raw, qtype.name, out, k)
    assert packed["qweight"].shape == (k, out // 8) and packed["scales"].shape == (k // 32, out)
    torch.testing.assert_close(dequantize_offset(**packed).t(), expected, atol=1e-6, rtol=1e-6)


def test_the_default_ggufs_q4_1_linears_repack_to_ggufs_own_numbers():
    reader = gguf.GGUFReader(default_gguf_path())
    assert gguf_int4.q4_source(reader) == "Q4_1"
    tensors = {t.name: t for t in reader.tensors}
    for name, heads in (("blk.0.attn_q.weight", 9), ("blk.7.attn_k.weight", 3), ("blk.29.ffn_down.weight", None)):
        t = tensors[name]
        expected = torch.from_numpy(gguf_dequantize(t.data, t.tensor_type).astype(np.float32))
        if heads:
            expected = unpermute_rotary_rows(expected, heads)
        packed = dict(gguf_int4.packed_tensors(name.replace("attn_q", "x.q_proj"), t, heads))
        base = name.replace("attn_q", "x.q_proj").removesuffix(".weight")
        w = dequantize_offset(packed[f"{base}.qweight"], packed[f"{base}.offsets"], packed[f"{base}.scales"])
        torch.testing.assert_close(w.t(), expected, atol=1e-6, rtol=1e-6)


def test_a_gguf_mixing_other_types_is_not_taken():
    def reader(*types):
        return SimpleNamespace(tensors=[SimpleNamespace(name=f"blk.0.{kind}.weight", tensor_type=t)
                                        for kind, t in zip(gguf_int4.LINEAR_KINDS, types)])
    assert gguf_int4.q4_source(reader(*[Q.Q4_1] * 7)) == "Q4_1"
    assert gguf_int4.q4_source(reader(*[Q.Q4_0] * 6, Q.Q4_1)) == "Q4_0+Q4_1"
    assert gguf_int4.q4_source(reader(*[Q.Q4_1] * 6, Q.Q6_K)) is None
    assert gguf_int4.q4_source(reader(*[Q.F16] * 7)) is None
    with pytest.raises(ValueError, match=r"m.gguf: quantization gguf runs decoder linears stored as Q4_0 or Q4_1; "
                                         r"this file stores them as Q4_1, Q6_K \(use quantization none"):
        gguf_int4.quant_config(reader(*[Q.Q4_1] * 6, Q.Q6_K), "m.gguf")


@pytest.mark.parametrize("kernel", [False, True])
def test_column_and_row_parallel_shards_of_the_offset_variant_add_up(kernel, monkeypatch):
    if kernel:
        need_kernels(int4=True)
    k, n = 128, 48
    p, b = random_offset_int4(k, n, 32, seed=3), torch.randn(n, generator=gen(2))
    x = torch.randn(3, k, generator=gen(3))
    whole = int4_linear_offset(x, p["qweight"], p["offsets"], p["scales"], b)

    def make(cls, rank, size):
        layer = cls(k, n, bias=True, method=Int4OffsetMethod(32, kernel=kernel), shard=ShardSpec(rank, size),
                    dtype=torch.float32, device=torch.device("cpu"))
        for name, tensor in (*p.items(), ("bias", b)):
            getattr(layer, name).weight_loader(getattr(layer, name), tensor)
        return layer
    assert set(make(ColumnParallelLinear, 0, 1)._parameters) == {"qweight", "scales", "offsets", "bias"}
    cols = torch.cat([make(ColumnParallelLinear, r, 2)(x) for r in range(2)], dim=1)
    torch.testing.assert_close(cols, whole, atol=1e-5, rtol=0)
    partials = []
    monkeypatch.setattr(ShardSpec, "all_reduce", lambda self, t: partials.append(t.clone()) or t)
    for rank in range(2):  # each rank its input rows (whole groups) and its part of x
        make(RowParallelLinear, rank, 2)(x[:, rank * k // 2:(rank + 1) * k // 2])
    torch.testing.assert_close(partials[0] + partials[1] + b, whole, atol=1e-5, rtol=0)


# ------------------------------------------------------------------------------ the default model


@pytest.fixture(scope="module")
def models():
    """(the default GGUF with its Q4_1 linears packed, the same file dequantized to fp32), both
    with the float head so that logits differ only by the linears' arithmetic."""
    ctx = dataclasses.replace(LayerContext.for_device("cpu", torch.float32), int8_head=False)
    return load_model(None, dataclasses.replace(ctx, gguf_q4=True)), load_model(None, ctx)


def logits(model, prompt, decodes, fused=True):
    """Every position's logits: the prompt as one chunk, then one decode step per token."""
    runner = ModelRunner(model, KVCache.for_model(model.config, num_blocks=8, block_size=16))
    if not fused:
        model.fused_decode = None  # this cache's steps per layer
    chunk = lambda toks, start: ScheduledChunk("a", toks, start, list(range(8)), True,  # noqa: E731
                                               SamplingParams(temperature=0.0))
    rows = [runner.compute_logits(SchedulerOutput([chunk(prompt, 0)]), all_tokens=True)["a"]]
    for i, t in enumerate(decodes):
        rows.append(runner.compute_logits(SchedulerOutput([chunk([t], len(prompt) + i)]))["a"])
    return torch.cat(rows)


def test_the_default_model_runs_its_q4_1_linears_packed_and_matches_the_dequantized_model(models):
    q4, fp32 = models
    linears = [m for name, m in q4.named_modules() if isinstance(m, LinearBase) and name != "lm_head"]
    assert len(linears) == 210 and all(isinstance(m.method, Int4OffsetMethod) for m in linears)
    assert not any(p.dtype.is_floating_point and p.dim() == 2 and p.dtype == torch.float32
                   for m in linears for p in m.parameters())
    assert "linears int4 GGUF Q4_1 g32" in q4.ctx.kernels
    prompt = torch.randint(0, 49152, (40,), generator=gen(7)).tolist()
    decodes = [int(t) for t in torch.randint(0, 49152, (6,), generator=gen(8))]
    a, b = logits(q4, prompt, decodes), logits(fp32, prompt, decodes)
    assert float((a - b).abs().max()) < 2e-3 * float(b.abs().max())  # rounding order only
    assert torch.equal(a.argmax(-1), b.argmax(-1))


@needs_int4_kernel
def test_fused_decode_steps_of_the_q4_model_equal_its_per_layer_steps(models):
    q4, _ = models
    prompt = torch.randint(0, 49152, (21,), generator=gen(9)).tolist()
    decodes = [int(t) for t in torch.randint(0, 49152, (5,), generator=gen(10))]
    fused = logits(q4, prompt, decodes)
    assert q4.fused_decode is not None and q4.fused_decode.layers[0].q.offsets
    assert torch.equal(fused, logits(q4, prompt, decodes, fused=False))


def test_offset_method_load_errors_name_the_gguf_format():
    method = Int4OffsetMethod(32, kernel=False, source="GGUF Q4_1")
    with pytest.raises(ValueError, match="int4 GGUF Q4_1: group size 32 does not divide a layer's input width 48"):
        ColumnParallelLinear(48, 16, bias=False, method=method, shard=ShardSpec(0, 1), dtype=torch.float32,
                            device=torch.device("cpu"))
    with pytest.raises(ValueError, match="int4 GGUF Q4_1: 12 output features is not a multiple of 8"):
        ColumnParallelLinear(64, 12, bias=False, method=method, shard=ShardSpec(0, 1), dtype=torch.float32,
                            device=torch.device("cpu"))
