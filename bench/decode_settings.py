"""Two settings of the engine, side by side in one run, on `make serve`'s model and settings
(the default GGUF, its Q4_1 linears run as stored, `quantization: gguf`) (issue 29 items 1, 5).

- `fp8-fused`: `kv_cache_dtype: fp8_e4m3` with calibrated scales, whose keys are stored minus
  their mean (KVLayer.k_offset): decode steps through the one-call C step (`fused_decode.py`,
  which subtracts the offset itself since dc4ee9d) against the per-layer Python path, what such a
  cache ran before. One engine: the baseline rows detach its FusedDecode, then put it back.
- `lm-head`: `lm_head: float` against `lm_head: int8` (the int4 model's int8 copy of its head;
  two engines), and the greedy agreement of the two heads' answers to the chat battery
  (bench/kv_quant.py's 36 CHAT_PROMPTS through the chat template, up to 48 new tokens, EOS stops).
- `decode-matmul`: `decode_matmul: fp32` against `auto` (bf16 products for decode steps of 16 rows
  or more, issue 41), and the chat battery's agreement (all 36 at once: steps of 32 rows).

Rows, each variant in turn within a round (the box's load shared alike; the order reversed every
other round, so a load that drifts favours neither); medians over the rounds
and the median of the per-round ratios (second variant / first):

- batch-1 decode: a 128-token prompt of pydoc text, 128 new tokens, (tokens - 1) / (last token
  time - first token time);
- C2: `bench/engine_throughput.py`'s workload (prompts 64-512 tokens, outputs 64-256, all added
  at t=0), output tokens per second of the run.

The engines take configs/default.yaml's settings (max_num_seqs 32, max_num_batched_tokens 512,
1 GiB of KV) with prefix caching off, so a repeated prompt is computed again.

    .venv/bin/python bench/decode_settings.py fp8-fused lm-head            # ~10 min on the shared box
    .venv/bin/python bench/decode_settings.py lm-head --requests 8 --rounds 1
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
for folder in (ROOT, ROOT / "bench"):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

from bench.engine_runs import build_workload, kvgate_run  # noqa: E402
from bench.kernel_paths import batch1, c2, text_ids  # noqa: E402

DEFAULT_SETTINGS = {"quantization": "gguf", "dtype": "float32", "max_num_seqs": 32, "max_num_batched_tokens": 512,
                    "kv_cache_bytes": 1 << 30, "enable_prefix_caching": False}  # configs/default.yaml's
CHAT_NEW_TOKENS = 48


def make_engine(model: str, threads: int, **overrides):
    from native_backend.config.cache_dir import tokenizer_cache_dir
    from native_backend.config.engine import EngineConfig
    from native_backend.process.factory import make_engine_core

    return make_engine_core(EngineConfig.build(path=model, num_threads=threads,
                                               tokenizer_cache_dir=str(tokenizer_cache_dir()),
                                               **{**DEFAULT_SETTINGS, **overrides}))


class Variant:
    """One side of a comparison: an engine, and what to set on it before its rows run."""

    def __init__(self, name: str, engine, enter=lambda: None):
        self.name, self.engine, self.enter = name, engine, enter


def fp8_fused_variants(model: str, threads: int) -> list[Variant]:
    engine = make_engine(model, threads, kv_cache_dtype="fp8_e4m3")
    ours = engine.core.executor.model
    kv = engine.core.executor.kv_cache.layers[0]
    fused = ours.fused_decode
    if kv.k_offset is None or fused is None:
        raise SystemExit(f"expected a calibrated fp8 cache (k_offset: {kv.k_offset is not None}) decoding through "
                         f"the fused step (fused_decode: {fused is not None})")

    def detach():
        ours.fused_decode = None

    def attach():
        ours.fused_decode = fused

    return [Variant("python", engine, detach), Variant("fused", engine, attach)]


def lm_head_variants(model: str, threads: int) -> list[Variant]:
    return [Variant(head, make_engine(model, threads, lm_head=head)) for head in ("float", "int8")]


def decode_matmul_variants(model: str, threads: int) -> list[Variant]:
    return [Variant(d, make_engine(model, threads, decode_matmul=d)) for d in ("fp32", "auto")]


COMPARISONS = {"fp8-fused": fp8_fused_variants, "lm-head": lm_head_variants, "decode-matmul": decode_matmul_variants}
WITH_CHAT = ("lm-head", "decode-matmul")  # comparisons whose numerics differ: the chat battery's agreement too


def one_round(variants: list[Variant], workload: dict, prompt: list[int], b1_new: int) -> dict[str, dict]:
    """Every row of every variant; the caller alternates the variants' order from round to round."""
    rows: dict[str, dict] = {"b1_decode_tok_s": {}, "c2_out_tok_s": {}}
    for v in variants:
        v.enter()
        rows["b1_decode_tok_s"][v.name] = batch1(v.engine, prompt, b1_new)
    for v in variants:
        v.enter()
        rows["c2_out_tok_s"][v.name] = c2(v.engine, workload)["out_tok_s"]
    return rows


def round_order(variants: list[Variant], r: int) -> list[Variant]:
    """The variants in round r's order: reversed every other round, so a drifting load favours neither."""
    return variants if r % 2 == 0 else variants[::-1]


def summarize(rounds: list[dict], names: list[str]) -> dict:
    """Per row: each variant's median over the rounds, its runs, and the median of the per-round
    ratios names[1] / names[0]."""

    base, other = names
    out = {}
    for row in rounds[0]:
        runs = {n: [r[row][n] for r in rounds] for n in names}
        ratios = [o / b for b, o in zip(runs[base], runs[other])]
        out[row] = {**{n: statistics.median(v) for n, v in runs.items()}, "runs": runs,
                    f"{other}_over_{base}": statistics.median(ratios)}
    return out


def chat_agreement(variants: list[Variant], model: str) -> dict:
    """The chat battery's greedy answers of the second variant against the first's."""
    from kv_quant import CHAT_PROMPTS, agreement

    from native_backend.config.cache_dir import tokenizer_cache_dir
    from native_backend.core.interface import EngineRequest
    from native_backend.core.sampling_params import SamplingParams
    from native_backend.text.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_pretrained(model, cache_dir=str(tokenizer_cache_dir()))
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in CHAT_PROMPTS]
    answers = []
    for v in variants:
        v.enter()
        got = {f"chat{i}": [] for i in range(len(prompts))}
        for i, prompt in enumerate(prompts):
            sampling = SamplingParams(max_tokens=CHAT_NEW_TOKENS, temperature=0.0)
            v.engine.add_request(EngineRequest(f"chat{i}", prompt, sampling))
        while v.engine.has_unfinished():
            for out in v.engine.step():
                got[out.request_id].extend(out.new_token_ids)
        answers.append([got[f"chat{i}"] for i in range(len(prompts))])
    base, other = answers
    return {**agreement(other, base), "same_first_token": sum(a[:1] == b[:1] for a, b in zip(other, base)),
            "capital": {v.name: tokenizer.decode(a[0]) for v, a in zip(variants, answers)}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("comparisons", nargs="+", choices=sorted(COMPARISONS))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=16, help="C2 requests")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--b1-new", type=int, default=128)
    parser.add_argument("--no-chat", action="store_true", help="skip the chat-battery agreement")
    parser.add_argument("--max-num-seqs", type=int, help="the engines' max_num_seqs (default: make serve's 32)")
    parser.add_argument("--out", default=str(ROOT / "bench/results/decode_settings.json"))
    args = parser.parse_args()

    import torch

    from native_backend.model.loader import default_gguf_path

    torch.set_num_threads(args.threads)
    if args.max_num_seqs:
        DEFAULT_SETTINGS["max_num_seqs"] = args.max_num_seqs
    model = default_gguf_path()
    spec = types.SimpleNamespace(seed=0, requests=args.requests, prompt_min=64, prompt_max=512, output_min=64,
                                 output_max=256, b1_prompt=128, b1_repeats=1)
    workload = build_workload(spec, model)
    prompt = text_ids(model)[:128]
    comparisons = {name: COMPARISONS[name](model, args.threads) for name in args.comparisons}
    for name, variants in comparisons.items():
        for v in variants:
            v.enter()
            print(f"{name} {v.name}: {v.engine.describe()}", flush=True)
            kvgate_run(v.engine, workload["warmup_prompts"], [8, 8], f"warmup-{name}-{v.name}-")
    load_start = os.getloadavg()
    rounds: dict[str, list] = {name: [] for name in comparisons}
    loads = []
    for r in range(args.rounds):
        loads.append(os.getloadavg()[0])
        print(f"[{time.strftime('%H:%M:%S')}] round {r + 1} of {args.rounds} (load {loads[-1]:.1f})", flush=True)
        for name, variants in comparisons.items():
            rounds[name].append(one_round(round_order(variants, r), workload, prompt, args.b1_new))
    report = {"model": str(model), "settings": DEFAULT_SETTINGS, "threads": args.threads, "rounds": args.rounds,
              "requests": args.requests, "b1_new": args.b1_new, "workload": workload["sha256"],
              "load_average_start": load_start, "load_average_rounds": loads, "results": {}}
    for name, variants in comparisons.items():
        report["results"][name] = summarize(rounds[name], [v.name for v in variants])
    for name in (n for n in WITH_CHAT if n in comparisons and not args.no_chat):
        report["results"][name]["chat"] = chat_agreement(comparisons[name], model)
    report["load_average_end"] = os.getloadavg()
    print_report(report)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


def print_report(report: dict) -> None:
    print(f"\nload average at start {report['load_average_start']}, at end {report['load_average_end']}")
    for name, rows in report["results"].items():
        for row, v in rows.items():
            if row == "chat":
                print(f"{name} chat battery: {v}")
                continue
            ratio = next(k for k in v if "_over_" in k)
            values = "  ".join(f"{k} {x:.1f}" for k, x in v.items() if k not in ("runs", ratio))
            print(f"{name:10s} {row:16s} {values}  {ratio} {v[ratio]:.2f}x  runs {v['runs']}")


if __name__ == "__main__":
    main()
