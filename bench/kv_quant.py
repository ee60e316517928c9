"""What a quantized KV cache costs in accuracy and buys in capacity, on the default model (CPU).

In one run, for every KV dtype (float32, bfloat16, fp8_e4m3, fp8_e5m2, int8):

- perplexity of SmolLM2-135M-Instruct on held-out text (the last 20480 tokens of
  pydoc_data.topics), sliding windows of WINDOW tokens every STRIDE tokens, each window one
  prefill through the paged cache (every attention read, the window's own keys included, goes
  through the stored format), its last STRIDE tokens scored (the first window: all of them);
- greedy agreement with the float32 cache: 16 prompts x 64 new tokens through the engine,
  how many sequences are identical and the mean share of tokens before the first difference;
- the chat battery (CHAT_PROMPTS, 36 questions through the model's chat template, none of them
  in the calibration): greedy answers (up to 48 tokens, stopping at EOS) against the float32
  cache's (identical answers, same first token, mean share before the first difference), the
  perplexity of the float32 cache's answers read back through each format (chat text: another
  kind than the calibration's and pydoc's), the fp8 values clamped (the engine's counters) and
  the answer to "What is the capital of France?";
- capacity and speed: the C2 workload of bench/engine_throughput.py (64 requests, prompts of
  64-512 tokens, outputs of 64-256) at a KV budget where float32 preempts (96 MiB): output tokens
  per second (output tokens only) and preemptions, float32 vs fp8_e4m3 vs int8.

fp8 scales come from the engine's calibration pass (kv_scales.calibration_ids: a few chat
turns and stdlib docstrings, not the evaluation text).

    .venv/bin/python bench/kv_quant.py [--quick] [--threads 2]

Writes bench/results/kv_quant.json and prints a table.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import sys
import time
from pathlib import Path
from unittest import mock

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

DTYPES = ("float32", "bfloat16", "fp8_e4m3", "fp8_e5m2", "int8")
# The ablation: fp8 with the previous calibration's keys, stored as they are (no KVLayer.k_offset).
UNCENTERED = "-uncentered"
ROWS = (*DTYPES, "fp8_e4m3" + UNCENTERED, "fp8_e5m2" + UNCENTERED)
CAPACITY_DTYPES = ("float32", "fp8_e4m3", "int8")
WINDOW, STRIDE, BLOCK = 512, 448, 16  # every scored token sees at least 64 tokens of context
CHAT_NEW_TOKENS = 48
CHAT_PROMPTS = (
    "What is the capital of France?", "What is the capital of Japan?", "Translate 'good morning' into Spanish",
    "Name three primary colors.", "How many days are in a week?", "What is 12 times 7?",
    "Write a haiku about the sea.", "Who wrote Romeo and Juliet?", "What is the boiling point of water in Celsius?",
    "Give me a synonym for 'happy'.", "What is photosynthesis?", "List the planets of the solar system.",
    "What language is spoken in Brazil?", "Explain what a computer program is in one sentence.",
    "What is the largest ocean on Earth?", "Suggest a name for a pet cat.", "What do bees make?",
    "How do I boil an egg?", "What is the opposite of 'cold'?", "Write a short greeting for a birthday card.",
    "What is the chemical symbol for gold?", "Why is the sky blue?", "Tell me a fun fact about elephants.",
    "What is the square root of 81?", "Who painted the Mona Lisa?", "What is the freezing point of water in Fahrenheit?",
    "Describe a rainbow in two sentences.", "What are the three states of matter?", "What is the capital of Italy?",
    "Recommend a healthy breakfast.", "What does a thermometer measure?", "How many legs does a spider have?",
    "Summarize the story of Cinderella in one sentence.", "What is the tallest mountain in the world?",
    "Write a Python function that adds two numbers.", "What is the main ingredient of guacamole?",
)


def held_out_ids(tokenizer, min_tokens: int) -> list[int]:
    from pydoc_data.topics import topics

    ids = tokenizer.encode("\n\n".join(topics.values()), add_special_tokens=False)
    if len(ids) < min_tokens:
        raise SystemExit(f"only {len(ids)} tokens of evaluation text")
    return ids[len(ids) - min_tokens:]  # the tail: the engine_throughput prompts come from the head


def kv_dtype_of(row: str) -> str:
    return row.removesuffix(UNCENTERED)


@contextlib.contextmanager
def calibration_of(row: str):
    """The engine's fp8 calibration as the row says: the keys centered (the engine's), or not."""
    from native_backend.execution import kv_scales

    if not row.endswith(UNCENTERED):
        yield
        return
    with mock.patch.object(kv_scales, "calibrate", functools.partial(kv_scales.calibrate, center_keys=False)):
        yield


def perplexity(model, ids: list[int], kv_dtype: str, calibration) -> float:
    """exp(mean NLL) over ids with sliding windows: every window after the first scores only its
    last STRIDE tokens, each seen with WINDOW - STRIDE tokens of context."""
    from native_backend.core.batch import ScheduledChunk, SchedulerOutput
    from native_backend.core.sampling_params import SamplingParams
    from native_backend.execution.kv_scales import apply
    from native_backend.execution.model_runner import ModelRunner
    from native_backend.model.kv_cache import KVCache

    blocks = WINDOW // BLOCK
    cache = KVCache.for_model(model.config, num_blocks=blocks + 1, block_size=BLOCK, dtype=kv_dtype)
    if calibration is not None:
        apply(cache, calibration.scales, calibration.k_offsets)
    runner = ModelRunner(model, cache)
    nll, count = 0.0, 0
    for start in range(0, len(ids) - WINDOW + 1, STRIDE):
        window = ids[start:start + WINDOW]
        scored = WINDOW - 1 if start == 0 else STRIDE  # rows whose next token is scored
        # logits of the last scored + 1 rows only (the head's matmul is a third of a window's work)
        chunk = ScheduledChunk("ppl", window, 0, list(range(1, blocks + 1)), True, SamplingParams(temperature=0.0),
                               num_logits=scored + 1)
        logits = runner.compute_logits(SchedulerOutput([chunk]))["ppl"]  # (scored + 1, vocab)
        logp = torch.log_softmax(logits[:-1].float(), dim=-1)
        target = torch.tensor(window[WINDOW - scored:])
        nll -= float(logp.gather(1, target[:, None]).sum())
        count += target.numel()
    return math.exp(nll / count)


def engine(kv_dtype: str, threads: int, **overrides):
    from native_backend.config.cache_dir import tokenizer_cache_dir
    from native_backend.config.engine import EngineConfig
    from native_backend.model.loader import default_gguf_path
    from native_backend.process.factory import make_engine_core

    return make_engine_core(EngineConfig.build(path=default_gguf_path(), num_threads=threads, kv_cache_dtype=kv_dtype,
                                        tokenizer_cache_dir=str(tokenizer_cache_dir()), **overrides))


def greedy_tokens(kv_dtype: str, prompts, new_tokens: int, threads: int) -> list[list[int]]:
    from engine_runs import kvgate_run

    e = engine(kv_dtype, threads, max_num_seqs=16)
    run = kvgate_run(e, prompts, [new_tokens] * len(prompts), "g")
    return [run["tokens"][rid] for rid in run["ids"]]


def agreement(ours: list[list[int]], base: list[list[int]]) -> dict:
    from engine_runs import first_divergence

    shares = [first_divergence(a, b) / len(b) for a, b in zip(ours, base)]
    return {"identical": sum(a == b for a, b in zip(ours, base)), "of": len(base),
            "mean_share_before_divergence": sum(shares) / len(shares)}


def chat_answers(row: str, prompts: list[list[int]], threads: int, **overrides) -> dict:
    """Greedy answers to every prompt (stopping at EOS), the fp8 values the engine clamped meanwhile,
    and the calibration its cache holds (to read the answers back through the same format)."""
    from native_backend.core.interface import EngineRequest
    from native_backend.core.sampling_params import SamplingParams
    from native_backend.execution.kv_scales import Calibration

    with calibration_of(row):
        e = engine(kv_dtype_of(row), threads, max_num_seqs=16, **overrides)
    answers = {f"c{i}": [] for i in range(len(prompts))}
    for i, p in enumerate(prompts):
        e.add_request(EngineRequest(f"c{i}", p, SamplingParams(max_tokens=CHAT_NEW_TOKENS, temperature=0.0)))
    while e.has_unfinished():
        for out in e.step():
            answers[out.request_id].extend(out.new_token_ids)
    stats = e.stats()
    layers = e.core.executor.kv_cache.layers
    return {"answers": [answers[f"c{i}"] for i in range(len(prompts))],
            "clamped": [stats.kv_clamped_keys, stats.kv_clamped_values],
            "calibration": Calibration([(layer.k_scale, layer.v_scale) for layer in layers],
                                       None if layers[0].k_offset is None else torch.stack([l.k_offset for l in layers]))
            if layers[0].dtype.scaling == "per_layer" else None}


def answers_perplexity(model, prompts: list[list[int]], answers: list[list[int]], kv_dtype: str,
                       calibration) -> float:
    """exp(mean NLL) of `answers` (the float32 cache's) after their prompts, each conversation one
    prefill through a `kv_dtype` cache holding the engine's `calibration` (fp8)."""
    from native_backend.core.batch import ScheduledChunk, SchedulerOutput
    from native_backend.core.sampling_params import SamplingParams
    from native_backend.execution.kv_scales import apply
    from native_backend.execution.model_runner import ModelRunner
    from native_backend.model.kv_cache import KVCache

    nll, count = 0.0, 0
    for prompt, answer in zip(prompts, answers):
        ids = prompt + answer
        blocks = math.ceil(len(ids) / BLOCK)
        cache = KVCache.for_model(model.config, num_blocks=blocks + 1, block_size=BLOCK, dtype=kv_dtype)
        if calibration is not None:
            apply(cache, calibration.scales, calibration.k_offsets)
        chunk = ScheduledChunk("chat", ids, 0, list(range(1, blocks + 1)), True, SamplingParams(temperature=0.0),
                               num_logits=len(answer) + 1)
        logits = ModelRunner(model, cache).compute_logits(SchedulerOutput([chunk]))["chat"]
        logp = torch.log_softmax(logits[:-1].float(), dim=-1)
        nll -= float(logp.gather(1, torch.tensor(answer)[:, None]).sum())
        count += len(answer)
    return math.exp(nll / count)


def chat_battery(model, tokenizer, threads: int) -> dict:
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in CHAT_PROMPTS]
    runs = {name: chat_answers(name, prompts, threads) for name in ROWS}
    base = runs["float32"]["answers"]
    report = {}
    for name, run in runs.items():
        ours = run["answers"]
        report[name] = {
            **agreement(ours, base),
            "same_first_token": sum(a[:1] == b[:1] for a, b in zip(ours, base)),
            "answers_ppl": answers_perplexity(model, prompts, base, kv_dtype_of(name), run["calibration"]),
            "clamped_k_v": run["clamped"],
            "capital": tokenizer.decode(ours[0]),
        }
        print(f"chat       {name:9s} {report[name]}", flush=True)
    f32 = report["float32"]["answers_ppl"]
    for r in report.values():
        r["answers_ppl_vs_float32_pct"] = 100 * (r["answers_ppl"] / f32 - 1)
    return report


def capacity(kv_dtype: str, workload: dict, kv_bytes: int, threads: int) -> dict:
    from engine_runs import kvgate_run, kvgate_warmup

    e = engine(kv_dtype, threads, kv_cache_bytes=kv_bytes)
    kvgate_warmup(e, {"workload": workload})
    before = e.stats()
    run = kvgate_run(e, workload["prompts"], workload["output_lens"], "c")
    stats = e.stats()
    out_tokens = sum(len(t) for t in run["tokens"].values())
    return {"kv_blocks": e.core.plan.num_blocks, "tokens_in_cache": e.core.plan.num_tokens, "wall_s": run["wall"],
            "out_tokens": out_tokens, "out_tok_s": out_tokens / run["wall"],
            "preemptions": stats.num_preemptions - before.num_preemptions, "describe": e.describe()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller text, fewer prompts and requests")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-cache-mib", type=int, default=96)
    ap.add_argument("--eval-tokens", type=int, default=20480, help="held-out tokens for perplexity (>= 20k for the table)")
    ap.add_argument("--requests", type=int, default=64, help="requests of the capacity workload")
    ap.add_argument("--dtypes", nargs="+", choices=ROWS, default=ROWS, help="perplexity of these dtypes only")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "kv_quant.json"))
    ap.add_argument("--only", nargs="+", choices=("perplexity", "greedy", "chat", "capacity"),
                    default=("perplexity", "greedy", "chat", "capacity"),
                    help="run these parts; the others keep what --out already holds")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    from engine_runs import build_workload

    from native_backend.config.cache_dir import tokenizer_cache_dir
    from native_backend.execution.kv_scales import calibrate, calibration_ids
    from native_backend.model.kv_cache import resolve_kv_dtype
    from native_backend.model.loader import default_gguf_path, load_model
    from native_backend.text.tokenizer import Tokenizer

    path = default_gguf_path()
    tokenizer = Tokenizer.from_pretrained(path, cache_dir=str(tokenizer_cache_dir()))
    model = load_model(path)
    eval_ids = held_out_ids(tokenizer, 4096 if args.quick else args.eval_tokens)
    calib = calibration_ids(tokenizer)
    out = Path(args.out)
    report = {"perplexity": {}, "greedy": {}, "chat": {}, "capacity": {}}
    report.update(json.loads(out.read_text()) if out.exists() else {})
    report.update({"model": os.path.basename(path), "eval_tokens": len(eval_ids), "window": WINDOW, "stride": STRIDE,
                   "threads": args.threads})
    for name in args.dtypes if "perplexity" in args.only else ():
        d = resolve_kv_dtype(kv_dtype_of(name))
        cal = (calibrate(model, calib, d, torch.device("cpu"), center_keys=not name.endswith(UNCENTERED))
               if d.scaling == "per_layer" else None)
        t0 = time.perf_counter()
        report["perplexity"][name] = {"ppl": perplexity(model, eval_ids, d.name, cal), "seconds": time.perf_counter() - t0}
        print(f"perplexity {name:9s} {report['perplexity'][name]['ppl']:.4f}", flush=True)
    if "perplexity" in args.only and "float32" in report["perplexity"]:
        base = report["perplexity"]["float32"]["ppl"]
        for r in report["perplexity"].values():
            r["vs_float32_pct"] = 100 * (r["ppl"] / base - 1)

    wl_args = argparse.Namespace(seed=0, requests=8 if args.quick else args.requests, prompt_min=64, prompt_max=512,
                                 output_min=64, output_max=256, b1_prompt=128, b1_repeats=2)
    workload = build_workload(wl_args, path)
    prompts = [p[:128] for p in workload["prompts"][:16]]
    new = 16 if args.quick else 64
    if "greedy" in args.only:
        tokens = {name: greedy_tokens(name, prompts, new, args.threads) for name in DTYPES}
        report["greedy"] = {name: agreement(tokens[name], tokens["float32"]) for name in DTYPES}
        for name in DTYPES:
            print(f"greedy     {name:9s} {report['greedy'][name]}", flush=True)
    if "chat" in args.only:
        report["chat"] = chat_battery(model, tokenizer, args.threads)
    if "capacity" in args.only:
        for name in CAPACITY_DTYPES:
            report["capacity"][name] = capacity(name, workload, args.kv_cache_mib << 20, args.threads)
            print(f"capacity   {name:9s} {report['capacity'][name]}", flush=True)
        f32 = report["capacity"]["float32"]["out_tok_s"]
        for r in report["capacity"].values():
            r["speed_vs_float32"] = r["out_tok_s"] / f32
    report[f"load_average_{'_'.join(args.only)}"] = os.getloadavg()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    if all(report[part] for part in ("perplexity", "greedy", "chat", "capacity")):
        print_table(report)
    return 0


def print_table(r: dict) -> None:
    print(f"\nKV dtype   perplexity (vs fp32)   greedy identical / mean share before divergence")
    for name, p in r["perplexity"].items():
        g = r["greedy"].get(name)
        greedy = f"{g['identical']:2d}/{g['of']}  {g['mean_share_before_divergence']:.2f}" if g else "-"
        print(f"{name:9s}  {p['ppl']:8.4f} ({p['vs_float32_pct']:+.2f} %)   {greedy}")
    print(f"\nKV dtype   chat: identical  same first token  before divergence  answers ppl (vs fp32)  clamped K/V")
    for name, c in r["chat"].items():
        print(f"{name:9s}  {c['identical']:2d}/{c['of']}  {c['same_first_token']:2d}/{c['of']}  "
              f"{c['mean_share_before_divergence']:.2f}  {c['answers_ppl']:.4f} ({c['answers_ppl_vs_float32_pct']:+.2f} %)  "
              f"{c['clamped_k_v']}  {c['capital']!r}")
    print(f"\nKV dtype   blocks  out tok/s (x fp32)  preemptions")
    for name, c in r["capacity"].items():
        print(f"{name:9s}  {c['kv_blocks']:6d}  {c['out_tok_s']:7.1f} ({c['speed_vs_float32']:.2f}x)  {c['preemptions']:6d}")


if __name__ == "__main__":
    sys.exit(main())
