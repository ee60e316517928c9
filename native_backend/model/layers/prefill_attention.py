"""Prefill's attention in bf16 on CPUs with AVX512_BF16 (`prefill_attention`).

A prompt chunk's attention grows with the context: a 4,096-token prompt in 512-token chunks
spends about three quarters of its prefill there (docs/engine/prefill.md), and at a few thousand
keys the float32 kernel waits on memory. `kvgate_prefill_attention_bf16`
(kernels/csrc/prefill_attention_bf16.c) runs the same FlashAttention loop with both products on
vdpbf16ps: Q, K, V and the probabilities rounded to bf16, sums and the softmax in float32.

    prefill_attention: fp32    never
                       bf16    where the kernel runs (the avx512 kernel path on a CPU with
                               AVX512_BF16); elsewhere float32, and the start-up line says why
                       auto    where the prefill matmuls already run in bf16 (the engine's prefill
                               is bf16 by choice) and a start-up probe measures the bf16 kernel
                               at least MIN_SPEEDUP x the float32 one

Only prompt chunks change (more than attention.cpu.SHORT_QUERY_MAX new tokens of a sequence, in a
step of at least attention.cpu.BF16_MIN_ROWS rows: the steps whose matmuls run in bf16); decode
rows and smaller steps keep their float32 kernels bit for bit. A quantized cache (fp8, int8) is
dequantized to float32 as before, then the kernel rounds it to bf16. The attention backend gets
the choice when the model is built (LayerContext, `get_attention_backend(..., prefill_bf16=)`).
"""

from __future__ import annotations

import functools

import torch

from native_backend.config.formats import PREFILL_ATTENTIONS
from native_backend.kernels import cpu_kernels
from native_backend.model.layers.prefill_matmul import PROBE_ROUNDS, best_of_alternating

MIN_SPEEDUP = 1.5  # auto: bf16 at least this much faster than float32 in the start-up probe
# q_len, ctx, heads, KV heads, head_dim: a 256-token chunk after 768 cached tokens, SmolLM2's heads
PROBE_SHAPE = (256, 1024, 9, 3, 64)


@functools.lru_cache(maxsize=1)  # once per process: every engine built in it agrees
def probe_speedup() -> float:
    """float32 kernel time / bf16 kernel time at PROBE_SHAPE on one thread, the fastest of
    PROBE_ROUNDS alternating rounds each (prefill_matmul's probe's method: a loaded box's load falls
    on both alike)."""
    q_len, ctx, heads, kv_heads, head_dim = PROBE_SHAPE
    blocks = ctx // 16
    k, v = (torch.randn(blocks, 16, kv_heads, head_dim) for _ in range(2))
    q, ids = torch.randn(q_len, heads, head_dim), torch.arange(blocks)

    def run(bf16: bool):
        return lambda: cpu_kernels.prefill_attention(q, k, v, ids, ctx, head_dim ** -0.5, bf16=bf16)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        fp32, bf16 = best_of_alternating(run(False), run(True), PROBE_ROUNDS)
    finally:
        torch.set_num_threads(threads)
    return fp32 / bf16


_followed: float | None = None  # a tensor-parallel worker: rank 0's measured speed-up (follow)


def auto_probe() -> float | None:
    """bf16's speed-up over float32 that `auto` decides from, where the bf16 kernel runs here (None
    where it does not: nothing to measure). A tensor-parallel worker returns rank 0's (follow)."""
    if _followed is not None:
        return _followed
    return None if cpu_kernels.bf16_prefill_problem() else probe_speedup()


def follow(speedup: float | None) -> None:
    """Decide `auto` from rank 0's auto_probe instead of this process's own probe, as
    prefill_matmul.follow does for the matmuls: the ranks of one engine choose alike."""
    global _followed
    _followed = speedup


def resolve(setting: str, *, device: torch.device, dtype: torch.dtype, bf16_matmuls: bool) -> tuple[bool, str]:
    """(bf16 prefill attention?, the start-up line's words for it). `bf16_matmuls`: the prefill
    matmuls' own resolution (prefill_matmul.resolve)."""
    if setting not in PREFILL_ATTENTIONS:
        raise ValueError(f"prefill_attention: {setting!r} is not one of {', '.join(PREFILL_ATTENTIONS)}")
    if device.type != "cpu" or dtype != torch.float32:
        return False, ""  # the model already runs in its own dtype everywhere
    if setting == "fp32":
        return False, "prefill attention fp32 (prefill_attention: fp32)"
    problem = cpu_kernels.bf16_prefill_problem()
    if setting == "bf16":
        if problem:
            return False, f"prefill attention fp32 (prefill_attention: bf16, but {problem})"
        return True, "prefill attention bf16 (prefill_attention: bf16)"
    if not bf16_matmuls:
        return False, "prefill attention fp32 (auto: prefill matmuls fp32)"
    if problem:
        return False, f"prefill attention fp32 (auto: {problem})"
    speedup = probe_speedup() if _followed is None else _followed
    chosen = "bf16" if speedup >= MIN_SPEEDUP else "fp32"
    q_len, ctx = PROBE_SHAPE[:2]
    return chosen == "bf16", (f"prefill attention {chosen} (auto: AVX512_BF16, bf16 {speedup:.1f}x fp32 at "
                              f"{q_len} queries x {ctx} keys)")
