"""The int4 linear as a Triton kernel (the CUDA path), with the contracts of reference.int4_linear
(AWQ's integer zero points) and reference.int4_linear_offset (GGUF Q4's float offsets, the offset
variant): one kernel, the variant a constexpr switch.

One program per (BLOCK_M rows of x, BLOCK_N columns of y) walks K one group at a time
(BLOCK_K = the group size, a power of two >= 16): it loads the group's x tile and the packed
words of its weight tile, unpacks each column from its word (column c of a run of 8 sits in
nibble (c >> 1) + 4 (c & 1): AWQ's order), applies the group's scale and its zero point
(W = (q - z) * s; z from the packed qzeros) or its offset (W = q * s + o; o fp16 (K/G, N)), and
accumulates x @ W with tl.dot in fp32 (IEEE: no TF32 rounding). The dequantized tile lives in
registers only. x may be fp32, bf16 or fp16 (read as fp32); y comes back in x's dtype.

Tested on CPU under TRITON_INTERPRET=1 against the reference (tests/native_backend/test_awq_triton.py);
`gpu_selfcheck` is bench/gpu_check.py's check of both variants on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _int4_linear_kernel(
    x_ptr, qweight_ptr, zeros_ptr, scales_ptr, y_ptr,
    M, N, K,
    stride_xm, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr, OFFSETS: tl.constexpr,
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
        s = tl.load(scales_ptr + g * N + cols, mask=col_ok, other=0.0).to(tl.float32)
        if OFFSETS:  # GGUF Q4: W = q * s + o (Q4_0: o = -8 s)
            o = tl.load(zeros_ptr + g * N + cols, mask=col_ok, other=0.0).to(tl.float32)
            w = q.to(tl.float32) * s[None, :] + o[None, :]
        else:  # AWQ: W = (q - z) * s, z packed like qweight
            zword = tl.load(zeros_ptr + g * words + cols // 8, mask=col_ok, other=0)
            z = (zword >> shift) & 0xF
            w = (q - z[None, :]).to(tl.float32) * s[None, :]
        acc += tl.dot(x.to(tl.float32), w, input_precision="ieee")
    tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], acc, mask=row_ok[:, None] & col_ok[None, :])


def int4_linear(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, K) float -> (M, N) in x's dtype; the AutoAWQ GEMM tensors as quantization/format.py."""
    return _launch(x, qweight, qzeros, scales, bias, offsets=False)


def int4_linear_offset(x: torch.Tensor, qweight: torch.Tensor, offsets: torch.Tensor, scales: torch.Tensor,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, K) float -> (M, N) in x's dtype; the offset variant's tensors (quantization/gguf_int4.py):
    qweight as AWQ's, scales and offsets fp16 (K/G, N)."""
    return _launch(x, qweight, offsets, scales, bias, offsets=True)


def _launch(x, qweight, zeros, scales, bias, *, offsets: bool) -> torch.Tensor:
    m, k = x.shape
    n = scales.shape[1]
    group = k // scales.shape[0]
    if group < 16 or group & (group - 1):  # the K tile is the group (the methods refuse these at load)
        raise ValueError(f"int4_linear (Triton): group size {group} must be a power of two >= 16")
    x = x.contiguous()
    y = torch.empty((m, n), dtype=torch.float32, device=x.device)
    block_m = 16 if m <= 16 else 32  # tl.dot wants every dimension >= 16
    block_n = 32
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _int4_linear_kernel[grid](x, qweight, zeros, scales, y, m, n, k, x.stride(0), y.stride(0),
                              BLOCK_M=block_m, BLOCK_N=block_n, GROUP=group, OFFSETS=offsets)
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype)


SMOLLM2_SHAPES = [(576, 576), (576, 192), (576, 1536), (1536, 576)]  # (in, out): q/o, k/v, gate/up, down


def gpu_selfcheck(device, shapes=SMOLLM2_SHAPES, rows=(1, 7, 64, 300)) -> dict:
    """bench/gpu_check.py's check (it calls every native_backend module's gpu_selfcheck): both
    variants, group 32, fp32 and bf16 x, against the reference of the same inputs in fp32 on
    `device`; relative to max |y|, 1e-5 for fp32 (IEEE dot) and bf16's own rounding of y."""
    from native_backend.model.quantization import reference
    from native_backend.model.quantization.format import pack_int4

    g = torch.Generator().manual_seed(0)
    failed, worst, cases = [], {"float32": 0.0, "bfloat16": 0.0}, 0
    for k, n in shapes:
        q, z = torch.randint(0, 16, (k, n), generator=g), torch.randint(0, 16, (k // 32, n), generator=g)
        s = (torch.rand(k // 32, n, generator=g) * 0.02 + 0.001).half()
        off = (torch.randn(k // 32, n, generator=g) * 0.05).half()
        variants = {"zero point": (int4_linear, reference.int4_linear, pack_int4(z)),
                    "offset": (int4_linear_offset, reference.int4_linear_offset, off)}
        for variant, (kernel, ref, zeros) in variants.items():
            tensors = [t.to(device) for t in (pack_int4(q), zeros, s, torch.randn(n, generator=g))]
            for m in rows:
                x = torch.randn(m, k, generator=g).to(device)
                for dtype, tolerance in (("float32", 1e-5), ("bfloat16", 8e-3)):
                    xd = x.to(getattr(torch, dtype))
                    y, expected = kernel(xd, *tensors), ref(xd.float(), *tensors)
                    err = float((y.float() - expected).abs().max() / expected.abs().max())
                    worst[dtype], cases = max(worst[dtype], err), cases + 1
                    if not err < tolerance or y.dtype != xd.dtype:
                        failed.append(f"{variant} {(m, k, n)} {dtype}: {err:.1e}")
    return {"ok": not failed, "cases": cases, "worst_rel_err": worst, "failed": failed}
