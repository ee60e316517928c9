"""Small-batch linear layers through kvgate's C kernel on x86-64 CPUs.

A decode step multiplies a few rows of activations by every weight of the model: it is weight
reads, nothing else. MKL's sgemv/sgemm reach about a third of the memory bandwidth there on the
CPU we measured (bench/engine_step_bench.py), the C kernel most of it, and its register tiles
stay ahead of MKL up to a few hundred rows; longer prefill chunks keep `F.linear` (MKL's blocked
GEMM).

`use_kernel_linears(model)` turns every `nn.Linear` of a model into a `KernelLinear` in place: same
parameters (tied weights stay tied), same state dict, same result within float32 rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from native_backend import cpu_kernels

# Rows up to which the kernel beats MKL on the 2-core AVX2 box we measure on: 1.4-3x at 1-64 rows,
# 1.1-1.2x at 96-224 over the model's layers, MKL ahead from 256 (bench/engine_step_bench.py's
# linear sweep, and a layers-only sweep at 96-256 rows).
KERNEL_MAX_ROWS = 224


class KernelLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        params = self._parameters  # one dict read; `self.weight` goes through nn.Module.__getattr__
        w, b = params["weight"], params["bias"]
        if _kernel_fits(x, w, b):
            return cpu_kernels.linear_unchecked(x, w, b)
        return F.linear(x, w, b)


def _kernel_fits(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> bool:
    """Called for every projection of every step: the cheap tests on x first."""
    return (x.dim() == 2 and x.shape[0] <= KERNEL_MAX_ROWS and x.dtype == torch.float32
            and x.device.type == "cpu" and not torch.is_grad_enabled() and w.shape[1] % 8 == 0
            and w.dtype == torch.float32 and w.device.type == "cpu" and w.is_contiguous()
            and (b is None or (b.dtype == torch.float32 and b.is_contiguous())))


def use_kernel_linears(model: nn.Module) -> int:
    """Swap every plain nn.Linear of `model` for a KernelLinear; the number swapped (0 when the
    kernels are unavailable here: the model is left as it was)."""
    if not cpu_kernels.available():
        return 0
    swapped = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = KernelLinear  # in place: parameters, hooks and ties are untouched
            swapped += 1
    return swapped
