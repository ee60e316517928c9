"""Int4 kernels against the reference (dequantize, then matmul): every SmolLM2 layer shape, ragged
row counts, the group sizes that divide, zero-point extremes; the linear method's packed shard
loaders."""

from __future__ import annotations

import pytest
import torch

from native_backend.kernels import cpu_kernels
from native_backend.model.layers.linear import ColumnParallelLinear, RowParallelLinear
from native_backend.model.layers.sharding import ShardSpec
from native_backend.model.quantization import rtn
from native_backend.model.quantization.format import pack_int4
from native_backend.model.quantization.method import AWQLinearMethod
from native_backend.model.quantization.reference import dequantize, int4_linear
from tests.support.checks.c_kernels import need_kernels

torch.set_num_threads(2)
needs_int4_kernel = pytest.mark.usefixtures("int4_kernel")  # skips only where the CPU cannot run it (tests/support/checks/c_kernels.py)
SMOLLM2_SHAPES = [(576, 576), (576, 192), (576, 1536), (1536, 576)]  # (in, out): q/o, k/v, gate/up, down
ROWS = [1, 2, 3, 4, 5, 7, 13, 64, 129, 300]
# Every shape with every group that divides its inputs (SmolLM2's 576 takes 32 and 64, not 128).
GROUPED_SHAPES = [(k, n, g) for k, n in SMOLLM2_SHAPES for g in (32, 64, 128) if k % g == 0]


def gen(seed):
    return torch.Generator().manual_seed(seed)


def random_int4(k, n, group, seed):
    """Random codes, zeros and positive fp16 scales of a (k, n) weight."""
    q = torch.randint(0, 16, (k, n), generator=gen(seed))
    z = torch.randint(0, 16, (k // group, n), generator=gen(seed + 1))
    s = (torch.rand(k // group, n, generator=gen(seed + 2)) * 0.02 + 0.001).half()
    return pack_int4(q), pack_int4(z), s


def rel_err(y, ref):
    return float((y - ref).abs().max() / ref.abs().max())


@pytest.mark.usefixtures("kernel_path")  # once per CPU kernel path (AVX2, AVX-512)
@needs_int4_kernel
@pytest.mark.parametrize("k,n,group", GROUPED_SHAPES)
def test_kernel_equals_the_reference(k, n, group):
    qweight, qzeros, scales = random_int4(k, n, group, seed=k + n + group)
    bias = torch.randn(n, generator=gen(5))
    for m in ROWS:
        x = torch.randn(m, k, generator=gen(m))
        ref = int4_linear(x, qweight, qzeros, scales, bias)
        assert rel_err(cpu_kernels.int4_linear(x, qweight, qzeros, scales, bias), ref) < 1e-5, (m, k, n, group)


@pytest.mark.usefixtures("kernel_path")  # once per CPU kernel path (AVX2, AVX-512)
@needs_int4_kernel
@pytest.mark.parametrize("n", [8, 24, 40, 112])  # a band of one word at the right edge
def test_kernel_edge_columns_and_no_bias(n):
    qweight, qzeros, scales = random_int4(64, n, 32, seed=n)
    for m in (1, 3, 6):
        x = torch.randn(m, 64, generator=gen(m))
        assert rel_err(cpu_kernels.int4_linear(x, qweight, qzeros, scales), int4_linear(x, qweight, qzeros, scales)) < 1e-5


@pytest.mark.usefixtures("kernel_path")  # once per CPU kernel path (AVX2, AVX-512)
@needs_int4_kernel
@pytest.mark.parametrize("code,zero", [(0, 0), (15, 15), (0, 15), (15, 0)])
def test_zero_point_extremes(code, zero):
    k, n, group = 128, 112, 64  # 112: a wide band of 64 columns (decode rows), then 48 in narrow bands
    qweight = pack_int4(torch.full((k, n), code))
    qzeros = pack_int4(torch.full((k // group, n), zero))
    scales = torch.full((k // group, n), 0.5).half()
    for m in (1, 2, 5):
        x = torch.randn(m, k, generator=gen(m))
        expected = x.sum(dim=1, keepdim=True) * (code - zero) * 0.5 * torch.ones(1, n)
        torch.testing.assert_close(int4_linear(x, qweight, qzeros, scales), expected, atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(cpu_kernels.int4_linear(x, qweight, qzeros, scales), expected, atol=1e-4,
                                   rtol=1e-5)


@needs_int4_kernel
def test_kernel_refuses_mismatched_tensors():
    qweight, qzeros, scales = random_int4(64, 16, 32, seed=0)
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="do not fit"):
        cpu_kernels.int4_linear(torch.randn(2, 32), qweight, qzeros, scales)
    with pytest.raises(ValueError, match="torch.int32"):
        cpu_kernels.int4_linear(x, qweight.float(), qzeros, scales)
    with pytest.raises(ValueError, match="torch.float16"):
        cpu_kernels.int4_linear(x, qweight, qzeros, scales.float())


def make(cls, k, n, *, kernel, shard=ShardSpec(), bias=True):
    return cls(k, n, bias=bias, method=AWQLinearMethod(32, kernel=kernel), shard=shard, dtype=torch.float32,
               device=torch.device("cpu"))


def load(layer, packed: rtn.Int4Weight, bias):
    for name, tensor in (*vars(packed).items(), ("bias", bias)):
        param = getattr(layer, name)
        param.weight_loader(param, tensor)


@pytest.mark.parametrize("kernel", [False, True])
def test_column_and_row_parallel_int4_shards_add_up_to_the_whole(kernel, monkeypatch):
    if kernel:
        need_kernels(int4=True)
    w, b = torch.randn(48, 128, generator=gen(1)), torch.randn(48, generator=gen(2))
    packed = rtn.quantize_weight(w, 32)
    x = torch.randn(3, 128, generator=gen(3))
    whole = int4_linear(x, packed.qweight, packed.qzeros, packed.scales, b)
    single = make(ColumnParallelLinear, 128, 48, kernel=kernel)
    load(single, packed, b)
    assert not any(p.dtype.is_floating_point and p.dim() == 2 and p.shape == (48, 128) for p in single.parameters())
    torch.testing.assert_close(single(x), whole, atol=1e-5, rtol=0)
    cols = []
    for rank in range(2):  # output columns split: each rank's packed words and scales
        layer = make(ColumnParallelLinear, 128, 48, kernel=kernel, shard=ShardSpec(rank, 2))
        load(layer, packed, b)
        assert layer.qweight.shape == (128, 3) and layer.scales.shape == (4, 24)
        cols.append(layer(x))
    torch.testing.assert_close(torch.cat(cols, dim=1), whole, atol=1e-5, rtol=0)
    partials = []
    monkeypatch.setattr(ShardSpec, "all_reduce", lambda self, t: partials.append(t.clone()) or t)
    for rank in range(2):  # input rows split on group boundaries: each rank's rows, groups and zeros
        layer = make(RowParallelLinear, 128, 48, kernel=kernel, shard=ShardSpec(rank, 2))
        load(layer, packed, b)
        assert layer.qweight.shape == (64, 6) and layer.qzeros.shape == (2, 6)
        layer(x[:, 64 * rank: 64 * rank + 64])
    torch.testing.assert_close(partials[0] + partials[1] + b, whole, atol=1e-5, rtol=0)


def test_int4_parameters_take_packed_tensors_only():
    layer = make(ColumnParallelLinear, 64, 16, kernel=False)
    with pytest.raises(ValueError, match="torch.float32 where torch.int32 is expected"):
        layer.qweight.weight_loader(layer.qweight, torch.zeros(64, 2))
    with pytest.raises(ValueError, match=r"\(64, 4\) does not fit parameter \(64, 2\)"):
        layer.qweight.weight_loader(layer.qweight, torch.zeros(64, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="group size 32 does not divide a layer's input width 48"):
        make(ColumnParallelLinear, 48, 16, kernel=False)


def test_reference_dequantizes_per_group():
    q = torch.arange(32).reshape(4, 8) % 16  # (in 4, out 8); group 2: rows 0-1 and rows 2-3
    z = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8], [0] * 8])
    scales = torch.tensor([[1.0] * 8, [0.5] * 8]).half()
    w = dequantize(pack_int4(q), pack_int4(z), scales)
    assert torch.equal(w, torch.cat([(q[:2] - z[0]) * 1.0, (q[2:] - z[1]) * 0.5]).float())


@pytest.mark.usefixtures("kernel_path")  # once per CPU kernel path (AVX2, AVX-512)
@needs_int4_kernel
@pytest.mark.parametrize("k", [576, 8, 40, 1000])  # the one-row path walks K 32 at a time, then by 8
def test_int8_rows_kernel_equals_torch(k):
    w8 = torch.randint(-127, 128, (1000, k), generator=gen(7), dtype=torch.int8)
    scale = torch.rand(1000, generator=gen(8)) * 0.01
    for m in (1, 3, 4, 6, 33):
        x = torch.randn(m, k, generator=gen(m))
        ref = x @ (w8.float() * scale[:, None]).t()
        assert rel_err(cpu_kernels.int8_rows(x, w8, scale), ref) < 1e-5, (m, k)
