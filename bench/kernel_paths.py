"""The CPU kernels' AVX2 path against their AVX-512 path, side by side in one run (issue 29 item 4).

One engine per model format is built once; the rounds then run every row on each path in turn
(avx2, avx512, avx2, avx512, ...), switching the library between rows (KVGATE_CPU_ISA and
`cpu_kernels.reset_choice()`: the kernels are looked up at every call, so the same engine, the
same weights and the same cache run both paths). Prefix caching is off, so a repeated prompt is
computed again. Rows (medians over the rounds; the ratio is avx512 / avx2, per round, then the
median):

- C2: `bench/engine_throughput.py`'s workload (64 requests, prompts 64-512 tokens of pydoc text,
  outputs 64-256, all added at t=0; fp32, max_num_seqs 64): OUTPUT tokens per second of the run;
- batch-1 decode, fp32 and int4 (the default GGUF's Q4_1 linears as stored, `quantization:
  gguf`, what `make serve` runs): a 128-token prompt, 128 new tokens, decode rate = (tokens - 1)
  / (last token time - first token time);
- TTFT: one prompt of 128 / 1024 tokens, max_tokens 1, time from add_request to the token, fp32
  and int4.

Also reported: whether the C2 greedy tokens of the two paths are identical.

    .venv/bin/python bench/kernel_paths.py            # ~10 minutes on the shared box
    .venv/bin/python bench/kernel_paths.py --quick    # 16 requests, 1 round
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.engine_runs import b1_numbers, build_workload, kvgate_run  # noqa: E402

MODELS = {"fp32": {}, "int4": {"quantization": "gguf"}}


def make_engine(model: str, threads: int, overrides: dict):
    from native_backend.config.cache_dir import tokenizer_cache_dir
    from native_backend.config.engine import EngineConfig
    from native_backend.process.factory import make_engine_core

    return make_engine_core(EngineConfig.build(path=model, num_threads=threads, enable_prefix_caching=False,
                                               max_num_seqs=64, tokenizer_cache_dir=str(tokenizer_cache_dir()),
                                               **overrides))


def use_path(name: str) -> None:
    from native_backend.kernels import cpu_kernels

    os.environ["KVGATE_CPU_ISA"] = name
    cpu_kernels.reset_choice()
    if cpu_kernels.path() is None or cpu_kernels.path().name != name:
        raise SystemExit(f"the {name} kernels do not run here: {cpu_kernels.unavailable_reason()}")


def c2(engine, workload) -> dict:
    run = kvgate_run(engine, workload["prompts"], workload["output_lens"], f"c2-{time.monotonic_ns()}-")
    tokens = [run["tokens"][rid] for rid in run["ids"]]
    return {"out_tok_s": sum(map(len, tokens)) / run["wall"], "tokens": tokens}


def batch1(engine, prompt: list[int], new: int) -> float:
    run = kvgate_run(engine, [prompt], [new], f"b1-{time.monotonic_ns()}-")
    return b1_numbers(run["start"], run["times"][run["ids"][0]])["decode_tok_s"]


def ttft(engine, prompt: list[int]) -> float:
    run = kvgate_run(engine, [prompt], [1], f"ttft-{time.monotonic_ns()}-")
    return run["times"][run["ids"][0]][0] - run["start"]


def text_ids(model: str) -> list[int]:
    from pydoc_data.topics import topics

    from native_backend.config.cache_dir import tokenizer_cache_dir
    from native_backend.text.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(model, cache_dir=str(tokenizer_cache_dir()))
    return tok.encode("\n\n".join(topics.values()), add_special_tokens=False)


def one_round(engines, workload, ids, paths, args) -> dict[str, dict]:
    """Every row on every path, path after path within each row (the box's load shared alike)."""
    rows: dict[str, dict] = {}

    def measure(row, fn):
        for p in paths:
            use_path(p)
            rows.setdefault(row, {})[p] = fn()

    measure("c2_fp32", lambda: c2(engines["fp32"], workload))
    for fmt in MODELS:
        measure(f"b1_decode_{fmt}", lambda fmt=fmt: batch1(engines[fmt], ids[:128], args.b1_new))
        for n in args.ttft:
            measure(f"ttft_{n}_{fmt}", lambda fmt=fmt, n=n: ttft(engines[fmt], ids[4096:4096 + n]))
    return rows


def summarize(rounds: list[dict], paths: list[str]) -> dict:
    """Per row: each path's median, the runs, and the median per-round speed-up of the last path
    over the first (tok/s: last / first; a time such as TTFT: first / last)."""
    base, other = paths[0], paths[-1]
    out = {}
    for row in rounds[0]:
        runs = {p: [r[row][p]["out_tok_s"] if row == "c2_fp32" else r[row][p] for r in rounds] for p in paths}
        ratios = [b / o if row.startswith("ttft") else o / b for b, o in zip(runs[base], runs[other])]
        out[row] = {**{p: statistics.median(v) for p, v in runs.items()}, "runs": runs,
                    f"{other}_speedup": statistics.median(ratios)}
    same = [a == b for r in rounds for a, b in zip(r["c2_fp32"][base]["tokens"], r["c2_fp32"][other]["tokens"])]
    out["c2_tokens_identical"] = f"{sum(same)} of {len(same)}"
    return out


def print_table(summary: dict, paths: list[str]) -> None:
    base, other = paths[0], paths[-1]
    print(f"\n{'row':24s} {base:>10s} {other:>10s}  {other} speed-up")
    for row, v in summary.items():
        if isinstance(v, dict):
            unit = "s" if row.startswith("ttft") else "tok/s"
            print(f"{row + ' (' + unit + ')':24s} {v[base]:10.3f} {v[other]:10.3f}  {v[f'{other}_speedup']:.2f}x")
    print(f"C2 greedy tokens identical across paths: {summary['c2_tokens_identical']} requests")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="16 requests, one round")
    parser.add_argument("--rounds", type=int, help="rounds (default 2; --quick: 1)")
    parser.add_argument("--requests", type=int, help="C2 requests (default 64; --quick: 16)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--paths", default="avx2,avx512", help="comma-separated kernel paths, the baseline first")
    parser.add_argument("--ttft", default="128,1024", help="TTFT prompt lengths")
    parser.add_argument("--b1-new", type=int, default=128)
    parser.add_argument("--out", help="JSON path (default bench/results/kernel_paths.json)")
    args = parser.parse_args()
    args.ttft = [int(n) for n in args.ttft.split(",")]
    paths = args.paths.split(",")
    rounds = args.rounds or (1 if args.quick else 2)

    import torch

    from native_backend.kernels import cpu_kernels
    from native_backend.model.loader import default_gguf_path

    torch.set_num_threads(args.threads)
    model = default_gguf_path()
    spec = types.SimpleNamespace(seed=0, requests=args.requests or (16 if args.quick else 64), prompt_min=64, prompt_max=512,
                                 output_min=64, output_max=256, b1_prompt=128, b1_repeats=1)
    workload = build_workload(spec, model)
    ids = text_ids(model)
    engines = {fmt: make_engine(model, args.threads, overrides) for fmt, overrides in MODELS.items()}
    for fmt, engine in engines.items():
        print(f"{fmt}: {engine.describe()}", flush=True)
        kvgate_run(engine, workload["warmup_prompts"], [8, 8], f"warmup-{fmt}-")
    load1 = os.getloadavg()[0]
    results = []
    for r in range(rounds):
        print(f"[{time.strftime('%H:%M:%S')}] round {r + 1} of {rounds}", flush=True)
        results.append(one_round(engines, workload, ids, paths, args))
    summary = summarize(results, paths)
    print_table(summary, paths)
    report = {"paths": {p: next(k.summary for k in cpu_kernels.PATHS if k.name == p) for p in paths},
              "cpu": _cpu_model(), "threads": args.threads, "rounds": rounds, "requests": spec.requests,
              "load_average_start": load1, "load_average_end": os.getloadavg()[0], "workload": workload["sha256"],
              "rows": summary}
    out = Path(args.out or ROOT / "bench/results/kernel_paths.json")
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")


def _cpu_model() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown"


if __name__ == "__main__":
    main()
