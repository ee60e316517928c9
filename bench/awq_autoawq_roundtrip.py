"""Our int4 packing against AutoAWQ's own: its GEMM packer (WQLinear_GEMM.from_linear) given our
RTN scales and zero points must write our qweight / qzeros / scales bit for bit, and its
dequantizer (dequantize_gemm) must read our tensors back to the weight.

AutoAWQ (deprecated; last tested with torch 2.6 and transformers 4.51) is not installed beside our
pins: its package import needs `datasets` and more, a venv of its own would pull another torch
build, and transformers' own AWQ loading goes through gptqmodel (torch >= 2.14.1; we pin 2.13).
Its packer and dequantizer are plain torch, so this loads those two modules from its source
release without the package __init__:

    .venv/bin/pip download --no-deps autoawq==0.2.9 -d /tmp/awqpkg && tar xzf /tmp/awqpkg/autoawq-0.2.9.tar.gz -C /tmp/awqpkg
    .venv/bin/python bench/awq_autoawq_roundtrip.py /tmp/awqpkg/autoawq-0.2.9
"""
import sys
import types
from pathlib import Path

import torch

SRC = sys.argv[1] if len(sys.argv) > 1 else "/tmp/awqpkg/autoawq-0.2.9"
for name in ("awq", "awq.modules", "awq.modules.linear", "awq.utils", "awq.modules.triton"):
    package = types.ModuleType(name)  # the packages' folders, without running their __init__
    package.__path__ = [f"{SRC}/{name.replace('.', '/')}"]
    sys.modules[name] = package
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from awq.modules.linear.gemm import WQLinear_GEMM  # noqa: E402
from awq.utils.packing_utils import dequantize_gemm  # noqa: E402

from native_backend.model.quantization import rtn  # noqa: E402
from native_backend.model.quantization.format import unpack_int4  # noqa: E402
from native_backend.model.quantization.reference import dequantize  # noqa: E402

torch.manual_seed(0)
ok = True
for (k, n, g) in [(576, 576, 64), (576, 192, 32), (1536, 576, 64), (576, 1536, 128)]:
    if k % g: continue
    w = torch.randn(n, k) * 0.05
    ours = rtn.quantize_weight(w, g)                       # qweight (k, n/8), qzeros (k/g, n/8), scales (k/g, n)
    wq = dequantize(ours.qweight, ours.qzeros, ours.scales)  # (k, n) float32: the weight int4 holds
    lin = torch.nn.Linear(k, n, bias=False); lin.weight.data = wq.t().contiguous()
    z = unpack_int4(ours.qzeros).float()                   # (k/g, n)
    theirs = WQLinear_GEMM.from_linear(lin, 4, g, scales=ours.scales.float(), zeros=z)
    same = [torch.equal(theirs.qweight, ours.qweight), torch.equal(theirs.qzeros, ours.qzeros),
            torch.equal(theirs.scales, ours.scales)]
    deq = dequantize_gemm(ours.qweight, ours.qzeros, ours.scales, 4, g)  # AutoAWQ reads our tensors
    print((k, n, g), "packer bit-identical (qweight, qzeros, scales):", same,
          "| their dequantizer on ours, max |diff|:", float((deq.float() - wq).abs().max()))
    ok &= all(same) and float((deq.float() - wq).abs().max()) < 1e-3  # theirs in fp16
sys.exit(0 if ok else 1)
