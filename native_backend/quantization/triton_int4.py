"""The int4 linear as a Triton kernel (the CUDA path), with reference.int4_linear's contract.

One program per (BLOCK_M rows of x, BLOCK_N columns of y) walks K one group at a time
(BLOCK_K = the group size, a power of two >= 16): it loads the group's x tile and the packed
words of its weight tile, unpacks each column from its word (column c of a run of 8 sits in
nibble (c >> 1) + 4 (c & 1): AWQ's order), applies the group's zero and scale, and accumulates
x @ W with tl.dot in fp32 (IEEE: no TF32 rounding). The dequantized tile lives in registers only.

Tested on CPU under TRITON_INTERPRET=1 against the reference (tests/native_backend/test_awq_triton.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _int4_linear_kernel(
    x_ptr, qweight_ptr, qzeros_ptr, scales_ptr, y_ptr,
    M, N, K,
    stride_xm, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    ks = tl.arange(0, GROUP)  # (GROUP,)
    row_ok, col_ok = rows < M, cols < N
    words = N // 8
    shift = ((cols % 8) // 2 + 4 * (cols % 2)) * 4  # (BLOCK_N,): the column's nibble in its word
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for g in range(0, K // GROUP):
        k = g * GROUP + ks
        x = tl.load(x_ptr + rows[:, None] * stride_xm + k[None, :], mask=row_ok[:, None], other=0.0)
        packed = tl.load(qweight_ptr + k[:, None] * words + (cols // 8)[None, :], mask=col_ok[None, :], other=0)
        q = (packed >> shift[None, :]) & 0xF  # (GROUP, BLOCK_N)
        zword = tl.load(qzeros_ptr + g * words + cols // 8, mask=col_ok, other=0)
        z = (zword >> shift) & 0xF
        s = tl.load(scales_ptr + g * N + cols, mask=col_ok, other=0.0).to(tl.float32)
        w = (q - z[None, :]).to(tl.float32) * s[None, :]
        acc += tl.dot(x.to(tl.float32), w, input_precision="ieee")
    tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], acc, mask=row_ok[:, None] & col_ok[None, :])


def int4_linear(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, K) float -> (M, N) in x's dtype; the AutoAWQ GEMM tensors as quantization/format.py."""
    m, k = x.shape
    n = scales.shape[1]
    group = k // scales.shape[0]
    if group < 16 or group & (group - 1):
        raise ValueError(f"int4_linear (Triton): group size {group} must be a power of two >= 16")
    x = x.contiguous()
    y = torch.empty((m, n), dtype=torch.float32, device=x.device)
    block_m = 16 if m <= 16 else 32  # tl.dot wants every dimension >= 16
    block_n = 32
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _int4_linear_kernel[grid](x, qweight, qzeros, scales, y, m, n, k, x.stride(0), y.stride(0),
                              BLOCK_M=block_m, BLOCK_N=block_n, GROUP=group)
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype)
