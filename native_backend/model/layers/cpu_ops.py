"""The decoder's small per-layer ops through kvgate's C kernels (csrc/layer_ops.c) on x86-64 CPUs.

In torch each of these is several dispatches and temporaries for a few multiplies per float:
RMSNorm after a residual add is an add and a norm kernel, RoPE of q and k is a roll, two
multiplies and an add each, SwiGLU's gate a silu and a multiply. Over a 64-request run they cost
about 6 s of ~80 (bench/engine_throughput.py's profile); here each is one pass over its rows.

Anything the kernels do not take (not float32, not contiguous, autograd on, odd sizes) goes to
`TorchOps`, so the same model runs either way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from native_backend.kernels import cpu_kernels
from native_backend.model.layers.norm import RMSNorm
from native_backend.model.layers.ops import TorchOps
from native_backend.model.layers.rotary import RotaryEmbedding


def _kernel_ready(*tensors: torch.Tensor) -> bool:
    """float32, contiguous, on the CPU, and no autograd (the kernels write in place)."""
    return not torch.is_grad_enabled() and cpu_kernels.readable(*tensors, dtype=torch.float32)


def check_positions(rotary: RotaryEmbedding, positions: torch.Tensor) -> None:
    """The kernels index the rotary tables without bounds checks: a step's positions are checked
    once (admission keeps them below the context length, so this is a guard, not a branch taken)."""
    if positions.numel() and not 0 <= int(positions.min()) <= int(positions.max()) < rotary.cos.shape[0]:
        raise IndexError(f"positions outside the rotary tables (0 .. {rotary.cos.shape[0] - 1})")


@dataclass
class _RopeTables:
    positions: torch.Tensor
    rotary: RotaryEmbedding

    def torch_tables(self):
        return self.rotary(self.positions)


class KernelOps(TorchOps):
    name = "C kernels"

    def add_rms_norm(self, residual, delta, norm: RMSNorm):
        w = norm.weight
        if not (delta.dim() == 2 and delta.shape[1] % 8 == 0 and _kernel_ready(delta, w)):
            return super().add_rms_norm(residual, delta, norm)
        if residual is None:  # the embeddings start the stream: it is theirs to keep
            return delta, cpu_kernels.add_rms_norm_(delta, None, w, norm.eps)
        if not _kernel_ready(residual):
            return super().add_rms_norm(residual, delta, norm)
        return residual, cpu_kernels.add_rms_norm_(residual, delta, w, norm.eps)

    def rope_tables(self, rotary: RotaryEmbedding, positions: torch.Tensor) -> _RopeTables:
        check_positions(rotary, positions)
        return _RopeTables(positions, rotary)

    def rope(self, q, k, tables: _RopeTables):
        rotary = tables.rotary
        positions = tables.positions
        if not (q.shape[-1] % 16 == 0 and positions.dtype == torch.int64 and positions.device.type == "cpu"
                and _kernel_ready(q, k, rotary.cos, rotary.sin)):
            return super().rope(q, k, tables.torch_tables())
        cpu_kernels.rope_qk_(q, k, positions, rotary.cos, rotary.sin)
        return q, k

    def silu_mul(self, gate, up):
        if not (gate.dim() == 2 and gate.shape == up.shape and gate.shape[1] % 8 == 0 and _kernel_ready(gate, up)):
            return super().silu_mul(gate, up)
        return cpu_kernels.silu_mul_(gate, up)


KERNEL_OPS = KernelOps()
