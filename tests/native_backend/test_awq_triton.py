"""The Triton int4 kernel, both variants, against the reference under TRITON_INTERPRET=1 (in a
subprocess, so the interpreter setting never leaks into other tests): ragged rows, edge columns,
group sizes, zero-point and offset extremes, bf16/fp16 inputs, a bias; every SmolLM2 layer shape
for the offset variant (GGUF Q4's group of 32, and 64/128), with Q4_0/Q4_1 blocks from gguf's own
quantizer. Then the int4 methods' CUDA dispatch to it, and its refusal at load of a group the
kernel cannot take; on a real GPU (skipped without one) the offset method's layer on CUDA."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from native_backend.model.layers.linear import ColumnParallelLinear
from native_backend.model.layers.sharding import ShardSpec
from native_backend.model.quantization import gguf_int4, reference
from native_backend.model.quantization.format import QuantConfig, pack_int4
from native_backend.model.quantization.method import AWQLinearMethod, Int4OffsetMethod, int4_method

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CASES = [  # (M, K, N, group)
    (1, 64, 40, 16), (5, 128, 64, 32), (17, 128, 48, 64), (33, 256, 96, 128), (3, 64, 8, 32),
]
# The offset variant: (M, K, N, group, x dtype); ~1-3 s each interpreted
OFFSET_CASES = [
    (1, 576, 576, 32, "float32"), (300, 576, 192, 32, "float32"), (33, 576, 1536, 32, "float32"),
    (7, 1536, 576, 32, "float32"), (129, 576, 576, 32, "float32"),  # SmolLM2: q/o, k/v, gate/up, down
    (17, 576, 576, 64, "float32"), (5, 1536, 576, 128, "float32"),
    (13, 576, 192, 32, "bfloat16"), (40, 576, 576, 32, "float16"),
    (3, 64, 8, 32, "float32"), (2, 96, 40, 32, "float32"), (5, 96, 104, 32, "float32"), (1, 64, 24, 16, "float32"),
]
EXTREMES = [(0, 0.0), (15, 0.0), (0, -4.0), (15, -7.5), (15, 2.0)]  # (code, offset): every weight the same
GGUF_TYPES = ["Q4_0", "Q4_1"]
TOLERANCE = {"float32": 1e-5, "float16": 1e-3, "bfloat16": 8e-3}  # relative to max |y|: y's own rounding


def rel_err(y, ref):
    return float((y.float() - ref).abs().max() / ref.abs().max())


def zero_point_checks() -> None:
    from native_backend.model.quantization.triton_int4 import int4_linear

    g = torch.Generator().manual_seed(0)
    for m, k, n, group in CASES:
        q = torch.randint(0, 16, (k, n), generator=g)
        z = torch.randint(0, 16, (k // group, n), generator=g)
        z[0] = 15  # zero-point extremes in the first group
        q[:group, :8] = 0
        s = (torch.rand(k // group, n, generator=g) * 0.02 + 0.001).half()
        x, bias = torch.randn(m, k, generator=g), torch.randn(n, generator=g)
        for dtype in ("float32", "bfloat16"):
            xd = x.to(getattr(torch, dtype))
            args = (pack_int4(q), pack_int4(z), s, bias)
            expected, got = reference.int4_linear(xd.float(), *args), int4_linear(xd, *args)
            err = rel_err(got, expected)
            assert got.dtype == xd.dtype and err < TOLERANCE[dtype], f"{(m, k, n, group, dtype)}: relative error {err}"
        print(f"zero point {(m, k, n, group)}: ok ({err:.1e})")


def offset_checks() -> None:
    from native_backend.model.quantization.triton_int4 import int4_linear_offset

    g = torch.Generator().manual_seed(1)
    for i, (m, k, n, group, dtype) in enumerate(OFFSET_CASES):
        codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
        codes[:8, :group] = torch.tensor([0, 15]).repeat_interleave(4)[:, None]  # code extremes in the first group
        d = (torch.rand(n, k // group, generator=g) * 0.02 + 0.001).half()
        off = (torch.randn(n, k // group, generator=g) * 0.05).half()
        off[:4, 0], off[4:8, 0] = 0.0, (d[4:8, 0].float() * -8).half()  # offset 0, and Q4_0's -8 d
        p = gguf_int4.to_int4_layout(codes, d, off)
        x = torch.randn(m, k, generator=g).to(getattr(torch, dtype))
        bias = torch.randn(n, generator=g) if i % 2 else None
        args = (p["qweight"], p["offsets"], p["scales"], bias)
        got, expected = int4_linear_offset(x, *args), reference.int4_linear_offset(x.float(), *args)
        err = rel_err(got, expected)
        assert got.dtype == x.dtype and err < TOLERANCE[dtype], f"{(m, k, n, group, dtype)}: relative error {err}"
        print(f"offset {(m, k, n, group, dtype)}: ok ({err:.1e})")


def offset_extreme_checks() -> None:
    from native_backend.model.quantization.triton_int4 import int4_linear_offset

    k, n = 96, 104  # 3 groups of 32; 104 columns: a partial tile of 8 at the right edge
    for code, offset in EXTREMES:
        p = gguf_int4.to_int4_layout(torch.full((n, k), code, dtype=torch.uint8), torch.full((n, k // 32), 0.5).half(),
                                     torch.full((n, k // 32), offset).half())
        x = torch.randn(5, k, generator=torch.Generator().manual_seed(code))
        expected = x.sum(dim=1, keepdim=True) * (code * 0.5 + offset) * torch.ones(1, n)
        for y in (reference.int4_linear_offset(x, p["qweight"], p["offsets"], p["scales"]),
                  int4_linear_offset(x, p["qweight"], p["offsets"], p["scales"])):
            torch.testing.assert_close(y, expected, atol=1e-4, rtol=1e-5)
        print(f"offset extreme {(code, offset)}: ok")


def gguf_block_checks() -> None:
    """Blocks written by gguf's own quantizer (Q4_0: offsets -8 d; Q4_1: its minimums), repacked."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize as gguf_quantize

    from native_backend.model.quantization.triton_int4 import int4_linear_offset

    out, k = 192, 576  # SmolLM2's k/v projection
    for qtype in GGUF_TYPES:
        w = np.random.default_rng(len(qtype)).standard_normal((out, k)).astype(np.float32)
        w[5] = 0.0  # an all-zero row: d = 0
        p = gguf_int4.repack(gguf_quantize(w, GGMLQuantizationType[qtype]), qtype, out, k)
        x = torch.randn(6, k, generator=torch.Generator().manual_seed(2))
        expected = reference.int4_linear_offset(x, p["qweight"], p["offsets"], p["scales"])
        err = rel_err(int4_linear_offset(x, p["qweight"], p["offsets"], p["scales"]), expected)
        assert err < 1e-5, f"{qtype}: relative error {err}"
        print(f"gguf {qtype}: ok ({err:.1e})")


def selfcheck_checks() -> None:
    """bench/gpu_check.py's check of both variants, run here on one small shape."""
    from native_backend.model.quantization.triton_int4 import gpu_selfcheck

    result = gpu_selfcheck("cpu", shapes=[(64, 40)], rows=(3,))
    assert result["ok"] and result["cases"] == 4, result
    print("selfcheck: ok")


CHECKS = {"zero_point": (zero_point_checks, len(CASES)),
          "offset": (offset_checks, len(OFFSET_CASES)),
          "offset_extremes": (offset_extreme_checks, len(EXTREMES)),
          "gguf_blocks": (gguf_block_checks, len(GGUF_TYPES)),
          "selfcheck": (selfcheck_checks, 1)}


@pytest.mark.parametrize("name", list(CHECKS))
def test_triton_int4_matches_the_reference_under_the_interpreter(name):
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": REPO_ROOT}
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), name], env=env, cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count(": ok") == CHECKS[name][1], proc.stdout


# ------------------------------------------------------------------------------ the methods' CUDA path


class CudaLooking(torch.Tensor):
    """A CPU tensor that says it is on CUDA: the methods' dispatch, checked without a GPU."""

    @property
    def is_cuda(self):
        return True


def make_layer(method, k=64, n=16, device="cpu"):
    return ColumnParallelLinear(k, n, bias=False, method=method, shard=ShardSpec(), dtype=torch.float32,
                                device=torch.device(device))


def offset_layer(method, k=64, n=16, device="cpu"):
    p = gguf_int4.to_int4_layout(torch.randint(0, 16, (n, k), dtype=torch.uint8), torch.rand(n, k // 32).half(),
                                 torch.randn(n, k // 32).half())
    layer = make_layer(method, k, n, device)
    for name, tensor in p.items():
        getattr(layer, name).weight_loader(getattr(layer, name), tensor.to(device))
    return layer, p


@pytest.mark.parametrize("variant", ["offset", "zero_point"])
def test_the_int4_methods_call_the_triton_kernel_on_cuda_tensors(variant, monkeypatch):
    from native_backend.model.quantization import triton_int4

    calls = []
    monkeypatch.setattr(triton_int4, f"int4_linear{'_offset' if variant == 'offset' else ''}",
                        lambda x, *tensors: calls.append((x, tensors)) or torch.zeros(x.shape[0], 16))
    method = Int4OffsetMethod(32, kernel=False, triton=True) if variant == "offset" \
        else AWQLinearMethod(32, kernel=False, triton=True)
    if variant == "offset":
        layer, _ = offset_layer(method)
        expected = [layer.qweight, layer.offsets, layer.scales]
    else:
        layer = make_layer(method)
        expected = [layer.qweight, layer.qzeros, layer.scales]
    x = torch.randn(2, 3, 64)
    assert layer(x.as_subclass(CudaLooking)).shape == (2, 3, 16)  # (batch, tokens) kept around the kernel's rows
    (rows, tensors), = calls
    assert rows.shape == (6, 64) and all(a is b for a, b in zip(tensors, [*expected, None]))
    layer(x)  # a CPU tensor: the reference (the C kernel is off here), not Triton
    assert len(calls) == 1


def test_gguf_q4_on_cuda_takes_the_triton_offset_method():
    method = int4_method(QuantConfig(group_size=32, quant_method="gguf Q4_1"), kernel=False, triton=True)
    assert isinstance(method, Int4OffsetMethod) and method.triton
    assert method.name == "int4 GGUF Q4_1 g32 (Triton)"
    cpu = int4_method(QuantConfig(group_size=32, quant_method="gguf Q4_0"), kernel=True, triton=False)
    assert not cpu.triton and cpu.name == "int4 GGUF Q4_0 g32 (C kernel)"


@pytest.mark.parametrize("group", [8, 24, 48])
def test_a_group_the_triton_kernel_cannot_take_is_refused_at_load(group):
    for method, label in ((Int4OffsetMethod(group, kernel=False, triton=True), "int4 GGUF Q4"),
                          (AWQLinearMethod(group, kernel=False, triton=True), "int4 AWQ")):
        with pytest.raises(ValueError, match=f"{label} on CUDA: group size {group} is not a power of two >= 16"):
            make_layer(method, k=384)
    make_layer(Int4OffsetMethod(group, kernel=False), k=384)  # the CPU paths take any group that divides


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the Triton kernel compiled for real")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_offset_method_on_a_gpu_equals_the_reference(dtype):
    method = int4_method(QuantConfig(group_size=32, quant_method="gguf Q4_1"), kernel=False, triton=True)
    layer, p = offset_layer(method, k=576, n=192, device="cuda")
    tensors = [p[name].cuda() for name in ("qweight", "offsets", "scales")]
    for m in (1, 7, 300):
        x = torch.randn(m, 576, device="cuda").to(dtype)
        expected = reference.int4_linear_offset(x.float(), *tensors)
        y = layer(x)
        assert y.dtype == dtype and rel_err(y, expected) < TOLERANCE[str(dtype).removeprefix("torch.")], m


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1"
    CHECKS[sys.argv[1]][0]()
