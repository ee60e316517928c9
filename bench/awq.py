"""AWQ int4 against round-to-nearest int4 and fp32 on SmolLM2-135M-Instruct, one run, CPU.

Rows: `fp32` (the default Q4_1 GGUF dequantized to fp32: the reference), `gguf q4_1` (that GGUF
with `quantization: gguf`: its Q4_1 linears run as stored by the int4 kernels), `rtn` and `awq`
(int4, group 64, written by `kvgate quantize` from the fp32 model; AWQ calibrated on the shipped
calibration text), their logits from the int8 copy of the head as the engine runs them, and
`awq (fp32 head)`: the AWQ model with logits from the float head (what int8 costs). Columns:

- perplexity on held-out text: `pydoc_data.topics` (all topics joined, tokenized with the model's
  tokenizer, no special tokens), the first --eval-tokens tokens (default 20480) in windows of
  --window (512) tokens, each window scored from its own start (no context carried over);
- top-1 agreement with fp32: over the same positions, how often the argmax token equals fp32's
  (teacher-forced: each model sees the true text);
- resident weight bytes: every parameter the engine holds (linears, embedding, norms), and the
  decoder's linear layers alone;
- batch-1 decode and C2 output tok/s of fp32, gguf q4_1 and awq in one run, interleaved, with the
  load average of each measurement (bench/awq_speed.py; rtn has awq's format and kernels). Skipped
  with --skip-speed.

- llama.cpp's own batch-1 decode of the same GGUF, the anchor, interleaved with the engines'
  (bench/llamacpp_b1.py in the venv `bash bench/llamacpp_server.sh install` builds, ~6 minutes
  once); left out, with a note, when that venv is not built or with --no-llamacpp.
- speed-only rows of the Q4_1 engine with one setting changed: `lm_head: float` (logits from the
  float head instead of its int8 copy: what the copy buys) and `prefill_matmul: fp32` (what bf16
  prefill buys, where the CPU has it);
- with --ttft, time to the first token of 128 / 1,024 / 4,096-token prompts on every speed row and
  llama.cpp (bench/awq_speed.py).

    .venv/bin/python bench/awq.py                      # quantizes (cached), then the table
    .venv/bin/python bench/awq.py --skip-speed --eval-tokens 4096
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FP32_HEAD = " (fp32 head)"  # a row of the AWQ model whose logits come from the float head
Q4_1 = "gguf q4_1"  # the default GGUF with quantization gguf: its Q4_1 linears run as stored (int4)
ROWS = ["fp32", Q4_1, "rtn", "awq", "awq" + FP32_HEAD]
SPEED_ROWS = ["fp32", Q4_1, "awq"]  # rtn has awq's format, bytes and kernels: the same speed
# The Q4_1 engine with one setting changed, speed only: what the int8 head copy and bf16 prefill buy.
SETTING_ROWS = {Q4_1 + " (float head)": {"lm_head": "float"}, Q4_1 + " (fp32 prefill)": {"prefill_matmul": "fp32"}}
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def checkpoint_dir(args, method: str) -> str:
    """The int4 checkpoint of `method`, made with `kvgate quantize` on first use (cached)."""
    from native_backend.config.cache_dir import kvgate_cache_dir

    out = getattr(args, f"{method}_dir") or str(kvgate_cache_dir() / "awq-bench" / f"smollm2-{method}-g{args.group_size}")
    if not os.path.exists(os.path.join(out, "config.json")):
        started = time.perf_counter()
        subprocess.run([sys.executable, "-m", "gateway.cli", "quantize", "default", "--method", method,
                        "--group-size", str(args.group_size), "--out", out], check=True, cwd=ROOT)
        print(f"quantized {method} in {time.perf_counter() - started:.0f}s -> {out}", file=sys.stderr)
    return out


def eval_windows(args) -> list[list[int]]:
    from pydoc_data.topics import topics

    from native_backend.config.cache_dir import tokenizer_cache_dir
    from native_backend.model.loader import default_gguf_path
    from native_backend.text.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(default_gguf_path(), cache_dir=str(tokenizer_cache_dir()))
    ids = tok.encode("\n\n".join(topics.values()), add_special_tokens=False)[:args.eval_tokens]
    return [ids[i:i + args.window] for i in range(0, len(ids) - args.window + 1, args.window)]


def score(model, windows: list[list[int]], float_head: bool = False) -> list[tuple]:
    """[(total negative log-likelihood, tokens scored, argmax of every scored position)] of the
    model's logits, and with float_head also of its head's float weight on the same hidden states."""
    import torch
    import torch.nn.functional as F

    from native_backend.core.batch import ScheduledChunk, SchedulerOutput
    from native_backend.core.sampling_params import SamplingParams
    from native_backend.execution.model_runner import ModelRunner
    from native_backend.model.kv_cache import KVCache

    block = 16
    runner = ModelRunner(model, KVCache.for_model(model.config, num_blocks=len(windows[0]) // block + 1, block_size=block))
    extra = []
    if float_head:  # the same hidden states through the float head too (bench-only hook)
        own = model.compute_logits
        model.compute_logits = lambda h: (extra.append(h @ model.lm_head.weight.t()), own(h))[1]
    totals = [[0.0, 0, []] for _ in range(1 + float_head)]
    for w in windows:
        table = list(range(len(w) // block + 1))
        chunk = ScheduledChunk("w", list(w), 0, table, True, SamplingParams(temperature=0.0))
        logits = runner.compute_logits(SchedulerOutput([chunk]), all_tokens=True)["w"]
        targets = torch.tensor(w[1:])
        for total, lg in zip(totals, [logits] + extra[-1:]):
            lg = lg[:-1].float()  # position i predicts w[i + 1]
            total[0] += float(F.cross_entropy(lg, targets, reduction="sum"))
            total[1] += len(targets)
            total[2].append(lg.argmax(-1))
        extra.clear()
    return [(nll, count, torch.cat(argmax)) for nll, count, argmax in totals]


def weight_bytes(model) -> tuple[int, int]:
    """(every weight the engine holds, the decoder's linear layers alone) in bytes; a tied head's
    float weight counted once, an int4 model's int8 head copy counted."""
    from native_backend.model.layers.linear import LinearBase
    from native_backend.model.quantization.method import _weight_buffers

    total = sum(t.numel() * t.element_size() for t in (*model.parameters(), *_weight_buffers(model)))
    linears = sum(p.numel() * p.element_size() for name, m in model.named_modules()
                  if isinstance(m, LinearBase) and name != "lm_head" for p in m.parameters())
    return total, linears


def accuracy_rows(args, paths: dict[str, str]) -> dict[str, dict]:
    import torch

    from native_backend.model.loader import load_model

    torch.set_num_threads(args.threads)
    windows = eval_windows(args)
    fp_argmax_file = Path(args.workdir) / f"fp32-argmax-{args.eval_tokens}-{args.window}.pt"
    rows = {}
    for name, path in paths.items():
        if name.endswith(FP32_HEAD):
            continue  # scored with the model it belongs to
        model = load_model(path, _context(name))
        started = time.perf_counter()
        with_float_head = name + FP32_HEAD in paths
        scores = score(model, windows, float_head=with_float_head)
        if name == "fp32":
            torch.save(scores[0][2], fp_argmax_file)
        fp_argmax = torch.load(fp_argmax_file)
        total, linears = weight_bytes(model)
        for row_name, (nll, count, argmax) in zip([name, name + FP32_HEAD], scores):
            bytes_ = (total - _int8_head_bytes(model), linears) if row_name.endswith(FP32_HEAD) else (total, linears)
            rows[row_name] = {"perplexity": math.exp(nll / count), "tokens_scored": count,
                              "top1_agreement_with_fp32": float((argmax == fp_argmax).float().mean()),
                              "weight_bytes": bytes_[0], "linear_weight_bytes": bytes_[1],
                              "eval_s": time.perf_counter() - started, "kernels": model.ctx.kernels}
            print(f"{row_name}: ppl {rows[row_name]['perplexity']:.3f} ({count} tokens, "
                  f"{rows[row_name]['eval_s']:.0f}s)", file=sys.stderr)
        del model
    return rows


def _context(name: str):
    """What the engine builds the row's model with (`quantization: gguf` for the Q4_1 row)."""
    import dataclasses

    import torch

    from native_backend.model.layers.context import LayerContext

    return dataclasses.replace(LayerContext.for_device("cpu", torch.float32), gguf_q4=name == Q4_1)


def _int8_head_bytes(model) -> int:
    from native_backend.model.quantization.method import _weight_buffers

    return sum(b.numel() * b.element_size() for b in _weight_buffers(model))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--rtn-dir", help="an existing RTN checkpoint (default: made and cached)")
    parser.add_argument("--awq-dir", help="an existing AWQ checkpoint (default: made and cached)")
    parser.add_argument("--eval-tokens", type=int, default=20480)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--no-llamacpp", action="store_true", help="leave out llama.cpp's batch-1 anchor row")
    parser.add_argument("--skip-accuracy", action="store_true")
    parser.add_argument("--rows", help="comma-separated subset of fp32,'gguf q4_1',rtn,awq,'awq (fp32 head)'; merged into "
                                       "--out's existing rows (perplexity is deterministic; speed is not)")
    parser.add_argument("--requests", type=int, default=64, help="C2 workload size")
    parser.add_argument("--b1-repeats", type=int, default=3, help="batch-1 prompts (each on every model)")
    parser.add_argument("--b1-new", type=int, default=128, help="batch-1 new tokens")
    parser.add_argument("--c2-repeats", type=int, default=1, help="C2 rounds (each on every model)")
    parser.add_argument("--ttft", action="store_true", help="also time to first token at 128 / 1k / 4k tokens")
    parser.add_argument("--ttft-repeats", type=int, default=3, help="TTFT rounds (each on every model)")
    parser.add_argument("--no-setting-rows", action="store_true",
                        help="leave out the Q4_1 engine's float-head and fp32-prefill speed rows")
    parser.add_argument("--kv-mib", type=int, default=1024, help="every speed engine's KV-cache budget")
    parser.add_argument("--workdir", default="/tmp/kvgate-awq-bench")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "awq.json"))
    args = parser.parse_args()
    os.makedirs(args.workdir, exist_ok=True)

    from native_backend.model.loader import default_gguf_path

    names = args.rows.split(",") if args.rows else ROWS
    methods = {"fp32": None, Q4_1: None, "rtn": "rtn", "awq": "awq", "awq" + FP32_HEAD: "awq"}  # the head's cost
    paths = {name: checkpoint_dir(args, methods[name]) if methods[name] else default_gguf_path() for name in names}
    rows = {} if args.skip_accuracy else accuracy_rows(args, paths)
    if not args.skip_speed:
        from awq_speed import llama_cpp_python, measure  # bench/awq_speed.py

        models = {name: (paths[name], {"quantization": "gguf" if name == Q4_1 else "none"})
                  for name in SPEED_ROWS if name in paths}
        if Q4_1 in paths and not args.no_setting_rows:
            models.update({name: (paths[Q4_1], {"quantization": "gguf", **settings})
                           for name, settings in SETTING_ROWS.items()})
        llama = None if args.no_llamacpp else llama_cpp_python()
        if not llama and not args.no_llamacpp:
            print("llama.cpp anchor left out: run `bash bench/llamacpp_server.sh install` first", file=sys.stderr)
        for name, row in measure(models, args, (llama, default_gguf_path()) if llama else None).items():
            rows.setdefault(name, {}).update(row)
    result = {"group_size": args.group_size, "eval_tokens": args.eval_tokens, "window": args.window,
              "threads": args.threads, "paths": paths, "rows": rows}
    if args.rows and Path(args.out).exists():  # a part of the table: merged into the rest
        previous = json.loads(Path(args.out).read_text())
        for name, row in previous["rows"].items():
            rows[name] = {**row, **rows.get(name, {})}
        result["paths"] = {**previous["paths"], **paths}
        order = ROWS + [n for n in rows if n not in ROWS]  # the table's rows, then the anchor
        rows = result["rows"] = {n: rows[n] for n in order if n in rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print_table(rows)


def print_table(rows: dict[str, dict]) -> None:
    fp = rows.get("fp32")
    if fp and "perplexity" in fp:
        print_accuracy(rows, fp)
    for name, r in rows.items():
        if r.get("b1_decode_tok_s"):
            c2 = f", C2 {r['c2_out_tok_s']:.1f} tok/s" if r.get("c2_out_tok_s") else ""
            print(f"{name:24} batch-1 decode {r['b1_decode_tok_s']:.1f} tok/s{c2}")
    for name, r in rows.items():
        if r.get("ttft_s"):
            print(f"{name:24} TTFT " + ", ".join(f"{n} tokens {t:.3f} s" for n, t in r["ttft_s"].items()))


def print_accuracy(rows: dict[str, dict], fp: dict) -> None:
    print(f"{'':17} {'ppl':>8} {'vs fp32':>8} {'top-1 agree':>12} {'weights MiB':>12} {'linears MiB':>12}")
    for name, r in rows.items():
        if "perplexity" not in r:
            continue
        print(f"{name:17} {r['perplexity']:8.3f} {100 * (r['perplexity'] / fp['perplexity'] - 1):+7.1f}% "
              f"{100 * r['top1_agreement_with_fp32']:11.1f}% {r['weight_bytes'] / 2**20:12.1f} "
              f"{r['linear_weight_bytes'] / 2**20:12.1f}")
    rtn, awq = rows.get("rtn"), rows.get("awq")
    if rtn and awq and rtn["perplexity"] > fp["perplexity"]:
        closed = (rtn["perplexity"] - awq["perplexity"]) / (rtn["perplexity"] - fp["perplexity"])
        print(f"AWQ closes {100 * closed:.0f}% of RTN's perplexity gap to fp32")


if __name__ == "__main__":
    main()
