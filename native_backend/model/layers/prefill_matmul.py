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

The probe (probe_speedup) times one PROBE_SHAPE product in float32 and in bf16, on one thread,
the two alternating PROBE_ROUNDS times, and compares the fastest of each. Under tensor
parallelism rank 0 probes and its workers follow its result (auto_probe / follow), so the ranks
of one engine never choose differently.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from native_backend.config.formats import DECODE_MATMULS, PREFILL_MATMULS

# Rows from which bf16 takes a product; below, the C kernels' float32 path stays. On the
# AVX512_BF16 box bf16 is ahead of the int4 C kernel from 32 rows (bench/prefill_matmul.py's row
# sweep), but a decode batch (up to max_num_seqs, 32 by default) keeps the float32 numerics it had.
BF16_MIN_ROWS = 64
# With decode_matmul bf16 (auto where prefill resolved to bf16): from this many rows every product takes the bf16
# copy, decode steps included. A decode step of the int4 model is compute, not weight reads, from a few rows on:
# on the AVX512_BF16 box, one thread, one SmolLM2 layer's seven products at 16 rows 1.36 ms in the int4 C kernel
# against 0.70 from the copy, at 32 rows 3.1 against 1.5, and the int8 head at 16 rows 28 ms against 18 ms in
# bf16 (at 8 rows the int8 head's 7 ms beat bf16's 13): docs/design/kernels.md's decode breakdown.
DECODE_BF16_MIN_ROWS = 16
# auto: bf16 at least this much faster than float32 in the start-up probe. On the AVX512_BF16 box
# (no AMX) the probe measured 3.5-16x on one thread, 60 probes at load averages 4-5 (two cores);
# a CPU that only emulates bf16 has no unit and is never probed. Below 1.5x the copy's memory
# (2 bytes a weight) and bf16's rounding would buy too little.
MIN_SPEEDUP = 1.5
PROBE_SHAPE = (256, 1024, 1024)  # rows, in, out: a prefill chunk's product, the size of a small model's MLP
# Alternating rounds, fastest of each kept: a shared box's load falls on both alike, and the least
# disturbed call is the kernel's own cost. On one thread: with two threads on two loaded cores the
# OpenMP stalls, not the kernels, set the ratio (0.8-31x for the same product; docs/engine/prefill.md).
PROBE_ROUNDS = 5

Probe = tuple[str | None, float | None]  # (the CPU's bf16 unit, bf16's speed-up; None: not measured)
_followed: Probe | None = None  # a tensor-parallel worker: rank 0's probe (follow)


def takes(x: torch.Tensor, min_rows: int = BF16_MIN_ROWS) -> bool:
    """A product bf16 runs: float32 on the CPU, at least `min_rows` rows (a prefill-sized chunk, or a
    decode step of DECODE_BF16_MIN_ROWS rows with decode_matmul bf16), no autograd."""
    return (x.dtype == torch.float32 and x.numel() >= min_rows * x.shape[-1] and x.device.type == "cpu"
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
    """float32 time / bf16 time of one PROBE_SHAPE product on one thread: the fastest of
    PROBE_ROUNDS alternating rounds each (the box may be loaded)."""
    rows, k, n = PROBE_SHAPE
    x, w = torch.randn(rows, k), torch.randn(n, k)
    xb, wb = x.bfloat16(), w.bfloat16()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        fp32, bf16 = best_of_alternating(lambda: F.linear(x, w), lambda: F.linear(xb, wb), PROBE_ROUNDS)
    finally:
        torch.set_num_threads(threads)
    return fp32 / bf16


def best_of_alternating(first: Callable[[], object], second: Callable[[], object], rounds: int) -> tuple[float, float]:
    """Seconds of each function's fastest call over `rounds` rounds of one call each, after one
    warm-up call each (oneDNN builds its kernel on the first)."""
    first(), second()
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(rounds):
        for fn, spent in zip((first, second), times):
            started = time.perf_counter()
            fn()
            spent.append(time.perf_counter() - started)
    return min(times[0]), min(times[1])


def auto_probe() -> Probe:
    """What `auto` decides from: the CPU's bf16 unit and, where it has one, bf16's speed-up over
    float32 measured on it. A tensor-parallel worker returns rank 0's (follow)."""
    if _followed is not None:
        return _followed
    unit = bf16_unit()
    return unit, probe_speedup() if unit else None


def follow(probe: Probe | None) -> None:
    """Decide `auto` from `probe` (rank 0's auto_probe) instead of this process's own: the ranks of
    one engine then choose alike, whatever each would measure while the others load. None: probe here."""
    global _followed
    _followed = probe


def resolve(setting: str, *, device: torch.device, dtype: torch.dtype, int4: bool) -> tuple[bool, str]:
    """(bf16 for prefill?, the start-up line's words for it)."""
    if setting not in PREFILL_MATMULS:
        raise ValueError(f"prefill_matmul: {setting!r} is not one of {', '.join(PREFILL_MATMULS)}")
    if device.type != "cpu" or dtype != torch.float32:
        return False, ""  # the model already runs in its own dtype everywhere
    if setting != "auto":
        rows = f" from {BF16_MIN_ROWS} rows" if setting == "bf16" else ""
        return setting == "bf16", f"prefill matmuls {setting}{rows} (prefill_matmul: {setting})"
    unit, speedup = _followed or (bf16_unit(), None)
    if unit is None:
        return False, "prefill matmuls fp32 (auto: no AMX or AVX512_BF16)"
    if not int4:
        return False, f"prefill matmuls fp32 (auto: float32 weights; {unit} with prefill_matmul: bf16)"
    speedup = probe_speedup() if speedup is None else speedup  # measured only where it decides something
    chosen = "bf16" if speedup >= MIN_SPEEDUP else "fp32"
    return chosen == "bf16", (f"prefill matmuls {chosen} from {BF16_MIN_ROWS} rows (auto: {unit}, bf16 "
                              f"{speedup:.1f}x fp32 at {'x'.join(map(str, PROBE_SHAPE))})")


def resolve_decode(setting: str, *, prefill_bf16: bool, device: torch.device, dtype: torch.dtype) -> tuple[int, str]:
    """(the rows from which every product runs in bf16: DECODE_BF16_MIN_ROWS, or BF16_MIN_ROWS where decode
    keeps float32; the start-up line's words). Decode multiplies prefill's bf16 copies, so it follows them:
    `auto` and `bf16` run where prefill's matmuls resolved to bf16."""
    if setting not in DECODE_MATMULS:
        raise ValueError(f"decode_matmul: {setting!r} is not one of {', '.join(DECODE_MATMULS)}")
    if device.type != "cpu" or dtype != torch.float32:
        return BF16_MIN_ROWS, ""
    if setting == "fp32":
        return BF16_MIN_ROWS, "decode matmuls fp32 (decode_matmul: fp32)"
    if not prefill_bf16:
        return BF16_MIN_ROWS, f"decode matmuls fp32 (decode_matmul: {setting}; prefill matmuls fp32)"
    return DECODE_BF16_MIN_ROWS, (f"decode matmuls bf16 from {DECODE_BF16_MIN_ROWS} rows (decode_matmul: {setting}"
                                  f"{', as prefill' if setting == 'auto' else ''})")
