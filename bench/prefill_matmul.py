"""bf16 prefill (`prefill_matmul`): does it pay on this CPU, from how many rows, and what does it cost
in numerics? SmolLM2-135M-Instruct, CPU, one run, each part side by side.

- `matmul`: torch float32 vs bf16 (oneDNN) GFLOP/s at prefill shapes (512 x 576 x 1536 and the
  model's others, the head's), 1 and 2 threads; best of --reps (the box is shared: the least
  disturbed run is the kernel's own cost).
- `rows`: one int4 decoder layer's seven products (the default GGUF's Q4_1 shapes) at 16-512 rows:
  the C kernel's float32 path, bf16 over a resident bf16 copy (what the engine runs), and bf16 of
  the weight dequantized per call (the copy-free alternative); best of --reps. Where
  prefill_matmul.BF16_MIN_ROWS should sit, and why the copy.
- `agreement`: the default GGUF with `quantization: gguf`, two engines in this process (--pair:
  prefill matmuls fp32 against bf16, prefill attention fp32 against bf16, or the LM head float
  against its int8 copy): (a) teacher-forced logits over --eval-tokens of held-out
  `pydoc_data.topics` text in --window-token prefill chunks (512; one chunk each, so attention
  sees up to that many keys): max and 99.9th percentile |logit difference|, top-1 agreement; (b) the
  36-prompt chat battery of bench/kv_quant.py through the chat template, greedy up to 48 new tokens
  (all prompts at once, so their prefill is one bf16 chunk): identical answers, same first token.
- `ttft`: time to the first token of one 128 / 1,024 / 4,096-token prompt (held-out text), the
  pair's two engines interleaved, median of --reps.

    .venv/bin/python bench/prefill_matmul.py                 # all parts -> bench/results/prefill_matmul.json
    .venv/bin/python bench/prefill_matmul.py --only matmul rows
    .venv/bin/python bench/prefill_matmul.py --only agreement --pair attention --window 2048
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

# (rows, in, out): SmolLM2's q/o, k/v, gate/up, down, then the head at the end of a chunk
MATMUL_SHAPES = [(512, 576, 1536), (512, 576, 576), (512, 576, 192), (512, 1536, 576), (128, 576, 1536),
                 (1024, 576, 1536), (64, 576, 49152)]
# (in, out) of q, k, v, o, gate, up, down
LAYER_SHAPES = [(576, 576), (576, 192), (576, 192), (576, 576), (576, 1536), (576, 1536), (1536, 576)]
ROW_SWEEP = (16, 32, 64, 128, 256, 512)
TTFT_LENGTHS = (128, 1024, 4096)
# --pair: the two engines (the default GGUF, quantization gguf) the agreement and ttft parts compare
PAIRS = {
    "prefill": {"base": {"prefill_matmul": "fp32", "prefill_attention": "fp32"},
                "test": {"prefill_matmul": "bf16", "prefill_attention": "fp32"}},
    # the attention of prompt chunks (layers/prefill_attention.py), the products bf16 in both
    "attention": {"base": {"prefill_matmul": "bf16", "prefill_attention": "fp32"},
                  "test": {"prefill_matmul": "bf16", "prefill_attention": "bf16"}},
    "head": {"base": {"lm_head": "float", "prefill_matmul": "fp32"},
             "test": {"lm_head": "int8", "prefill_matmul": "fp32"}},
}


def _best_time(fn, reps: int) -> float:
    """Seconds of fn's fastest of `reps` calls after one warm-up (oneDNN builds its kernel on the
    first call): on a shared box the least disturbed run is the kernel's own cost."""
    fn()
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times)


def matmul_part(args) -> list[dict]:
    import torch

    rows = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for m, k, n in MATMUL_SHAPES:
            x, w = torch.randn(m, k), torch.randn(n, k)
            xb, wb = x.bfloat16(), w.bfloat16()
            t32 = _best_time(lambda: F.linear(x, w), args.reps)
            t16 = _best_time(lambda: F.linear(xb, wb), args.reps)
            flops = 2 * m * k * n
            row = {"threads": threads, "shape": [m, k, n], "fp32_gflops": flops / t32 / 1e9,
                   "bf16_gflops": flops / t16 / 1e9, "bf16_speedup": t32 / t16}
            rows.append(row)
            print(f"matmul {threads}t {m}x{k}x{n}: fp32 {row['fp32_gflops']:.0f} GFLOP/s, bf16 "
                  f"{row['bf16_gflops']:.0f}, {row['bf16_speedup']:.2f}x", flush=True)
    torch.set_num_threads(args.threads)
    return rows


def rows_part(args) -> list[dict]:
    """One Q4_1-shaped layer's seven products: the C kernel's float32 path (what decode and short
    chunks run), bf16 over a resident bf16 copy (what prefill_matmul runs), and bf16 of the weight
    dequantized per call (the alternative that keeps no copy)."""
    import torch

    from native_backend.kernels import cpu_kernels
    from native_backend.model.quantization import reference
    from native_backend.model.quantization.format import pack_int4

    torch.set_num_threads(args.threads)
    weights = []
    for k, n in LAYER_SHAPES:
        q = pack_int4(torch.randint(0, 16, (k, n)))
        s, off = (torch.rand(k // 32, n) * 0.01).half(), (torch.randn(k // 32, n) * 0.01).half()
        weights.append((q, off, s, reference.dequantize_offset(q, off, s).t().contiguous().bfloat16()))
    out = []
    for m in ROW_SWEEP:
        xs = [torch.randn(m, k) for k, _ in LAYER_SHAPES]
        paths = {
            "c_kernel": lambda: [cpu_kernels.int4_linear_off_unchecked(x, q, o, s, None)
                                 for x, (q, o, s, _) in zip(xs, weights)],
            "bf16_copy": lambda: [F.linear(x.bfloat16(), w).float() for x, (*_, w) in zip(xs, weights)],
            "bf16_dequant_per_call": lambda: [
                (x.bfloat16() @ reference.dequantize_offset(q, o, s).bfloat16()).float()
                for x, (q, o, s, _) in zip(xs, weights)],
        }
        row = {"rows": m, **{f"{name}_ms": _best_time(fn, args.reps) * 1e3 for name, fn in paths.items()}}
        out.append(row)
        print(f"layer {m:4d} rows: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items() if k != "rows"), flush=True)
    return out


def _engine(threads: int, **overrides):
    from native_backend.config.cache_dir import tokenizer_cache_dir
    from native_backend.config.engine import EngineConfig
    from native_backend.model.loader import default_gguf_path
    from native_backend.process.factory import make_engine_core

    return make_engine_core(EngineConfig.build(
        path=default_gguf_path(), quantization="gguf", num_threads=threads,
        tokenizer_cache_dir=str(tokenizer_cache_dir()), kv_cache_bytes=256 << 20, **overrides))


def _held_out(tokenizer, n: int) -> list[int]:
    from kv_quant import held_out_ids

    return held_out_ids(tokenizer, n)


def _logits(engine, ids: list[int]):
    """Every position's logits of one prefill chunk through the engine's own model and cache."""
    from native_backend.core.batch import ScheduledChunk, SchedulerOutput
    from native_backend.core.sampling_params import SamplingParams

    blocks = list(range(1, len(ids) // 16 + 2))
    chunk = ScheduledChunk("t", list(ids), 0, blocks, True, SamplingParams(temperature=0.0))
    return engine.core.executor.compute_logits(SchedulerOutput([chunk]), all_tokens=True)["t"].float()


def agreement_part(args, engines, tokenizer) -> dict:
    import torch

    from kv_quant import CHAT_PROMPTS, agreement
    from native_backend.core.interface import EngineRequest
    from native_backend.core.sampling_params import SamplingParams

    ids = _held_out(tokenizer, args.eval_tokens)
    diffs, same, total = [], 0, 0
    w = args.window
    for start in range(0, len(ids) - w + 1, w):
        window = ids[start:start + w]
        a, b = (_logits(engines[p], window) for p in ("base", "test"))
        diffs.append((a - b).abs().flatten())
        same += int((a.argmax(-1) == b.argmax(-1)).sum())
        total += len(window)
    d = torch.cat(diffs)
    logits = {"positions": total, "window": w, "max_abs_diff": float(d.max()),
              "p999_abs_diff": float(d.kthvalue(int(0.999 * d.numel())).values),
              "mean_abs_diff": float(d.mean()), "top1_agreement": same / total}
    print(f"logits over {total} positions: {logits}", flush=True)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in CHAT_PROMPTS]
    answers = {}
    for p in ("base", "test"):
        e = engines[p]
        got = {f"c{i}": [] for i in range(len(prompts))}
        for i, prompt in enumerate(prompts):
            e.add_request(EngineRequest(f"c{i}", prompt, SamplingParams(max_tokens=48, temperature=0.0)))
        while e.has_unfinished():
            for out in e.step():
                got[out.request_id].extend(out.new_token_ids)
        answers[p] = [got[f"c{i}"] for i in range(len(prompts))]
    chat = {**agreement(answers["test"], answers["base"]),
            "same_first_token": sum(a[:1] == b[:1] for a, b in zip(answers["test"], answers["base"])),
            "capital_base": tokenizer.decode(answers["base"][0]), "capital_test": tokenizer.decode(answers["test"][0])}
    print(f"chat battery: {chat}", flush=True)
    return {"logits": logits, "chat": chat}


def ttft_part(args, engines, tokenizer) -> dict:
    from native_backend.core.interface import EngineRequest
    from native_backend.core.sampling_params import SamplingParams

    text = _held_out(tokenizer, max(TTFT_LENGTHS) * (args.reps + 2))
    times = {p: {n: [] for n in TTFT_LENGTHS} for p in engines}
    for r in range(args.reps + 1):  # run 0: warm-up, not counted
        for n in TTFT_LENGTHS:
            prompt = text[r * n:(r + 1) * n]  # a fresh prompt each time: no prefix-cache hit
            for p, e in engines.items():
                started = time.perf_counter()
                e.add_request(EngineRequest(f"t{r}-{n}", prompt, SamplingParams(max_tokens=1, temperature=0.0)))
                while e.has_unfinished():
                    e.step()
                if r:
                    times[p][n].append(time.perf_counter() - started)
    out = {p: {n: statistics.median(v) for n, v in by_n.items()} for p, by_n in times.items()}
    for n in TTFT_LENGTHS:
        print(f"TTFT {n:5d} tokens: base {out['base'][n]:.3f} s, test {out['test'][n]:.3f} s, "
              f"{out['base'][n] / out['test'][n]:.2f}x", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="+", choices=("matmul", "rows", "agreement", "ttft"),
                    default=("matmul", "rows", "agreement", "ttft"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pair", choices=PAIRS, default="prefill",
                    help="agreement/ttft: prefill matmuls fp32 vs bf16, prefill attention fp32 vs bf16, or the "
                         "LM head float vs its int8 copy")
    ap.add_argument("--window", type=int, default=512, help="agreement: tokens per teacher-forced prefill chunk")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--eval-tokens", type=int, default=4096)
    ap.add_argument("--out", default=str(ROOT / "bench/results/prefill_matmul.json"))
    args = ap.parse_args()
    import torch

    from native_backend.model.layers import prefill_matmul

    report = {"cpu_bf16_unit": prefill_matmul.bf16_unit(), "threads": args.threads, "pair": PAIRS[args.pair],
              "load_average_start": os.getloadavg(),
              "torch": torch.__version__, "bf16_min_rows": prefill_matmul.BF16_MIN_ROWS}
    if "matmul" in args.only:
        report["matmul"] = matmul_part(args)
    if "rows" in args.only:
        report["rows"] = rows_part(args)
    if {"agreement", "ttft"} & set(args.only):
        engines = {p: _engine(args.threads, **settings) for p, settings in PAIRS[args.pair].items()}
        tokenizer = _tokenizer()
        report["engines"] = {p: e.describe() for p, e in engines.items()}
        if "agreement" in args.only:
            report["agreement"] = agreement_part(args, engines, tokenizer)
        if "ttft" in args.only:
            report["ttft_s"] = ttft_part(args, engines, tokenizer)
    report["load_average_end"] = os.getloadavg()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


def _tokenizer():
    from native_backend.config.cache_dir import tokenizer_cache_dir
    from native_backend.model.loader import default_gguf_path
    from native_backend.text.tokenizer import Tokenizer

    return Tokenizer.from_pretrained(default_gguf_path(), cache_dir=str(tokenizer_cache_dir()))


if __name__ == "__main__":
    main()
