"""The decoder's small operations, called through an ops object: `TorchOps` (the reference).

A decoder layer calls its norms, its rotary embedding and its gate through the ops its
`LayerContext` chose, so a device brings fused kernels without a second model: `TorchOps` is the
reference and the default; `cpu_ops.KernelOps` runs them through kvgate's C kernels on x86-64
CPUs. The residual stream is carried with the norm that follows each add (`add_rms_norm`), which
is where a fused kernel saves a pass.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from native_backend.model.layers.norm import RMSNorm
from native_backend.model.layers.rotary import RotaryEmbedding, apply_rope


class TorchOps:
    """The reference implementation of every op a layer calls through `ops`."""

    name = "torch"

    def add_rms_norm(self, residual: torch.Tensor | None, delta: torch.Tensor, norm: RMSNorm):
        """(residual + delta, norm(residual + delta)); residual None: delta starts the stream (the
        embeddings)."""
        h = delta if residual is None else residual + delta
        return h, norm(h)

    def rope_tables(self, rotary: RotaryEmbedding, positions: torch.Tensor):
        """Once per step, whatever `rope` needs for these positions (shared by every layer)."""
        return rotary(positions)

    def rope(self, q: torch.Tensor, k: torch.Tensor, tables) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = tables
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """SwiGLU's silu(gate) * up."""
        if torch.is_grad_enabled():  # autograd needs the intermediate tensors intact
            return F.silu(gate) * up
        return F.silu(gate, inplace=True).mul_(up)  # no temporaries: inference


TORCH_OPS = TorchOps()
