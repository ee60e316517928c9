"""Prefill's matrix products in bf16 on CPUs with bf16 matrix instructions (`prefill_matmul`).

A prompt's chunk multiplies hundreds of rows by every weight: compute-bound, unlike a decode
step. On a CPU with AVX512_BF16 (vdpbf16ps) or AMX tiles, oneDNN's bf16 GEMM (what torch runs for
a bf16 matmul on the CPU) does several times the float32 rate: 4-8x at SmolLM2's shapes on one
core of the AVX512_BF16 box we measured (no AMX; docs/engine/prefill.md has the figures). So a
chunk of at least BF16_MIN_ROWS rows goes

    x (rows, in) float32 --round--> bf16 ┐
                                         ├─ oneDNN GEMM, fp32 accumulation, out rounded to bf16
    W  bf16 copy (made at load)          ┘                           --widen--> y float32 (+ bias)

and every other product (decode, short chunks) keeps its float32 path. The weight is a bf16 copy
made once after loading (`weight_bf16`, (out, in), 2 bytes a weight beside the float32 or packed
int4 weight; `kvgate plan --prefill-matmul` counts it): dequantizing int4 per call instead cost
more than the bf16 GEMM itself (10-14 ms against 3-26 ms for one SmolLM2 layer at 128-512 rows,
one core), leaving prefill no faster than the C kernel below 256 rows.

    prefill_matmul: fp32    never
                    bf16    always (CPU, float32 activations)
                    auto    int4 linears on a CPU with AMX or AVX512_BF16 where a start-up probe
                            measures bf16 at least MIN_SPEEDUP x float32; a float model keeps the
                            dtype it was asked for (`dtype: bfloat16` is the all-bf16 choice)
"""

from __future__ import annotations

import functools
import time

import torch
import torch.nn.functional as F

from native_backend.config.formats import PREFILL_MATMULS

# Rows from which bf16 takes a product; below, the C kernels' float32 path stays. On the
# AVX512_BF16 box bf16 is ahead of the int4 C kernel from 32 rows (bench/prefill_matmul.py's row
# sweep), but a decode batch (up to max_num_seqs, 32 by default) keeps the float32 numerics it had.
BF16_MIN_ROWS = 64
MIN_SPEEDUP = 1.5  # auto: bf16 at least this much faster than float32 in the start-up probe
PROBE_SHAPE = (256, 1024, 1024)  # rows, in, out: a prefill chunk's product, the size of a small model's MLP


def takes(x: torch.Tensor) -> bool:
    """A product bf16 runs: a prefill-sized float32 chunk on the CPU, no autograd."""
    return (x.dtype == torch.float32 and x.numel() >= BF16_MIN_ROWS * x.shape[-1] and x.device.type == "cpu"
            and not torch.is_grad_enabled())


def keep_bf16_copy(layer: torch.nn.Module, weight_out_in: torch.Tensor) -> None:
    """The layer's bf16 copy of its weight (out, in), a buffer beside the weight as stored."""
    layer.register_buffer("weight_bf16", weight_out_in.detach().to(torch.bfloat16).contiguous(), persistent=False)


def linear(x: torch.Tensor, layer: torch.nn.Module, bias: torch.Tensor | None) -> torch.Tensor:
    """x (..., in) float32 times the layer's bf16 copy -> (..., out) float32 (+ bias, in float32)."""
    y = F.linear(x.to(torch.bfloat16), layer._buffers["weight_bf16"]).float()
    return y if bias is None else y + bias


def bf16_unit() -> str | None:
    """The CPU's bf16 matrix instructions as torch sees them: "AMX", "AVX512_BF16" or None."""
    cpu = getattr(torch, "cpu", None)
    if getattr(cpu, "_is_amx_tile_supported", lambda: False)():
        return "AMX"
    if getattr(cpu, "_is_avx512_bf16_supported", lambda: False)():
        return "AVX512_BF16"
    return None


@functools.lru_cache(maxsize=1)  # once per process: every engine built in it agrees
def probe_speedup() -> float:
    """float32 time / bf16 time of one PROBE_SHAPE product, best of 3 each (the box may be loaded)."""
    rows, k, n = PROBE_SHAPE
    x, w = torch.randn(rows, k), torch.randn(n, k)
    xb, wb = x.bfloat16(), w.bfloat16()
    return best_of(lambda: F.linear(x, w)) / best_of(lambda: F.linear(xb, wb))


def best_of(fn, reps: int = 3) -> float:
    """Seconds of fn's fastest of `reps` calls after one warm-up: on a shared box the least
    disturbed run is the kernel's own cost."""
    fn()  # oneDNN builds its kernel on the first call
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times)


def resolve(setting: str, *, device: torch.device, dtype: torch.dtype, int4: bool) -> tuple[bool, str]:
    """(bf16 for prefill?, the start-up line's words for it)."""
    if setting not in PREFILL_MATMULS:
        raise ValueError(f"prefill_matmul: {setting!r} is not one of {', '.join(PREFILL_MATMULS)}")
    if device.type != "cpu" or dtype != torch.float32:
        return False, ""  # the model already runs in its own dtype everywhere
    if setting != "auto":
        rows = f" from {BF16_MIN_ROWS} rows" if setting == "bf16" else ""
        return setting == "bf16", f"prefill matmuls {setting}{rows} (prefill_matmul: {setting})"
    unit = bf16_unit()
    if unit is None:
        return False, "prefill matmuls fp32 (auto: no AMX or AVX512_BF16)"
    if not int4:
        return False, f"prefill matmuls fp32 (auto: float32 weights; {unit} with prefill_matmul: bf16)"
    speedup = probe_speedup()
    chosen = "bf16" if speedup >= MIN_SPEEDUP else "fp32"
    return chosen == "bf16", (f"prefill matmuls {chosen} from {BF16_MIN_ROWS} rows (auto: {unit}, bf16 "
                              f"{speedup:.1f}x fp32 at {'x'.join(map(str, PROBE_SHAPE))})")
