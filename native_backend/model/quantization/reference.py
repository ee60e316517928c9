"""The reference arithmetic of int4 weights: dequantize, then an ordinary matmul.

Every kernel (C, Triton) has this contract and is tested against it:

    x (M, in) float  ->  y (M, out) = x @ W + bias,   W[i, o] = (q[i, o] - z[i // g, o]) * s[i // g, o]

The weight is dequantized in float32 whatever x's dtype, then multiplied in x's dtype.

The offset variant (GGUF's Q4_0 / Q4_1, quantization/gguf_int4.py) has a float offset per group in
place of the zero point: W[i, o] = q[i, o] * s[i // g, o] + off[i // g, o].
"""

from __future__ import annotations

import torch

from native_backend.model.quantization.format import unpack_int4


def dequantize(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(in, out) float32 from qweight (in, out/8), qzeros (in/g, out/8), scales (in/g, out)."""
    groups, out = scales.shape
    q = unpack_int4(qweight).view(groups, -1, out)  # (in/g, g, out) int32
    z = unpack_int4(qzeros).unsqueeze(1)  # (in/g, 1, out)
    return ((q - z).float() * scales.float().unsqueeze(1)).view(-1, out)


def int4_linear(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """(M, in) -> (M, out): the reference every int4 kernel must equal."""
    w = dequantize(qweight, qzeros, scales).to(x.dtype)  # (in, out), transient
    y = x @ w
    return y if bias is None else y + bias


def dequantize_offset(qweight: torch.Tensor, offsets: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(in, out) float32 of the offset variant: q * s + off per group."""
    groups, out = scales.shape
    q = unpack_int4(qweight).view(groups, -1, out).float()  # (in/g, g, out)
    return (q * scales.float().unsqueeze(1) + offsets.float().unsqueeze(1)).view(-1, out)


def int4_linear_offset(x: torch.Tensor, qweight: torch.Tensor, offsets: torch.Tensor, scales: torch.Tensor,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
    """(M, in) -> (M, out): the reference of the offset variant."""
    y = x @ dequantize_offset(qweight, offsets, scales).to(x.dtype)
    return y if bias is None else y + bias
