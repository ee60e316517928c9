"""AWQ int4 against round-to-nearest int4 and fp32 on SmolLM2-135M-Instruct, one run, CPU.

Rows: `fp32` (the default Q4_1 GGUF dequantized to fp32: the reference), `rtn` and `awq` (int4,
group 64, written by `kvgate quantize` from that same fp32 model; AWQ calibrated on the shipped
calibration text), their logits from the int8 copy of the head as the engine runs them, and
`awq (fp32 head)`: the AWQ model with logits from the float head (what int8 costs). Columns:

- perplexity on held-out text: `pydoc_data.topics` (all topics joined, tokenized with the model's
  tokenizer, no special tokens), the first --eval-tokens tokens (default 20480) in windows of
  --window (512) tokens, each window scored from its own start (no context carried over);
- top-1 agreement with fp32: over the same positions, how often the argmax token equals fp32's
  (teacher-forced: each model sees the true text);
- resident weight bytes: every parameter the engine holds (linears, embedding, norms), and the
  decoder's linear layers alone;
- batch-1 decode and throughput: `bench/engine_throughput.py --skip-hf` run on each model (the same
  workload and the same definitions: batch-1 decode-only output tok/s of a 128-token prompt with 128
  new tokens, median of --b1-repeats prompts; throughput = output tok/s of --requests requests
  added at once). Skipped with --skip-speed.

llama.cpp's own batch-1 rate on the GGUF (the issue's anchor) needs `bash bench/llamacpp_server.sh
install` (a ~6 minute build); it is not run here.

    .venv/bin/python bench/awq.py                      # quantizes (cached), then the table
    .venv/bin/python bench/awq.py --skip-speed --eval-tokens 4096
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FP32_HEAD = " (fp32 head)"  # a row of the AWQ model whose logits come from the float head
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def checkpoint_dir(args, method: str) -> str:
    """The int4 checkpoint of `method`, made with `kvgate quantize` on first use (cached)."""
    from native_backend.cache_dir import kvgate_cache_dir

    out = getattr(args, f"{method}_dir") or str(kvgate_cache_dir() / "awq-bench" / f"smollm2-{method}-g{args.group_size}")
    if not os.path.exists(os.path.join(out, "config.json")):
        started = time.perf_counter()
        subprocess.run([sys.executable, "-m", "gateway.cli", "quantize", "default", "--method", method,
                        "--group-size", str(args.group_size), "--out", out], check=True, cwd=ROOT)
        print(f"quantized {method} in {time.perf_counter() - started:.0f}s -> {out}", file=sys.stderr)
    return out


def eval_windows(args) -> list[list[int]]:
    from pydoc_data.topics import topics

    from native_backend.cache_dir import tokenizer_cache_dir
    from native_backend.loader import default_gguf_path
    from native_backend.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(default_gguf_path(), cache_dir=str(tokenizer_cache_dir()))
    ids = tok.encode("\n\n".join(topics.values()), add_special_tokens=False)[:args.eval_tokens]
    return [ids[i:i + args.window] for i in range(0, len(ids) - args.window + 1, args.window)]


def score(model, windows: list[list[int]]):
    """(total negative log-likelihood, tokens scored, argmax of every scored position)."""
    import torch
    import torch.nn.functional as F

    from native_backend.batch import ScheduledChunk, SchedulerOutput
    from native_backend.kv_cache import KVCache
    from native_backend.model_runner import ModelRunner
    from native_backend.sampling_params import SamplingParams

    block = 16
    runner = ModelRunner(model, KVCache.for_model(model.config, num_blocks=len(windows[0]) // block + 1, block_size=block))
    nll, count, argmax = 0.0, 0, []
    for w in windows:
        table = list(range(len(w) // block + 1))
        chunk = ScheduledChunk("w", list(w), 0, table, True, SamplingParams(temperature=0.0))
        logits = runner.compute_logits(SchedulerOutput([chunk]), all_tokens=True)["w"][:-1]  # predicts w[1:]
        targets = torch.tensor(w[1:])
        nll += float(F.cross_entropy(logits.float(), targets, reduction="sum"))
        count += len(targets)
        argmax.append(logits.argmax(-1))
    return nll, count, torch.cat(argmax)


def weight_bytes(model) -> tuple[int, int]:
    """(every weight the engine holds, the decoder's linear layers alone) in bytes; a tied head's
    float weight counted once, an int4 model's int8 head copy counted."""
    from native_backend.layers.linear import LinearBase
    from native_backend.quantization.method import _weight_buffers

    total = sum(t.numel() * t.element_size() for t in (*model.parameters(), *_weight_buffers(model)))
    linears = sum(p.numel() * p.element_size() for name, m in model.named_modules()
                  if isinstance(m, LinearBase) and name != "lm_head" for p in m.parameters())
    return total, linears


def accuracy_rows(args, paths: dict[str, str]) -> dict[str, dict]:
    import torch

    from native_backend.layers.context import LayerContext
    from native_backend.loader import load_model

    torch.set_num_threads(args.threads)
    windows = eval_windows(args)
    rows, fp_argmax = {}, None
    for name, path in paths.items():
        ctx = LayerContext.for_device("cpu", torch.float32)
        model = load_model(path, dataclasses.replace(ctx, int8_head=not name.endswith(FP32_HEAD)))
        started = time.perf_counter()
        nll, count, argmax = score(model, windows)
        total, linears = weight_bytes(model)
        fp_argmax = argmax if fp_argmax is None else fp_argmax
        rows[name] = {"perplexity": math.exp(nll / count), "tokens_scored": count,
                      "top1_agreement_with_fp32": float((argmax == fp_argmax).float().mean()),
                      "weight_bytes": total, "linear_weight_bytes": linears, "eval_s": time.perf_counter() - started,
                      "kernels": model.ctx.kernels}
        print(f"{name}: ppl {rows[name]['perplexity']:.3f} ({count} tokens, {rows[name]['eval_s']:.0f}s)",
              file=sys.stderr)
        del model
    return rows


def speed(args, path: str) -> dict:
    out = Path(args.workdir) / f"speed-{Path(path).name}.json"
    cmd = [sys.executable, "bench/engine_throughput.py", "--skip-hf", "--model", path, "--out", str(out),
           "--threads", str(args.threads), "--requests", str(args.requests), "--b1-repeats", str(args.b1_repeats)]
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    r = json.loads(out.read_text())
    return {"b1_decode_tok_s": r["batch1"]["kvgate_decode_tok_s"], "throughput_out_tok_s": r["kvgate_out_tok_s"],
            "engine": r["config"]["engine"], "load_average": r["machine"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--rtn-dir", help="an existing RTN checkpoint (default: made and cached)")
    parser.add_argument("--awq-dir", help="an existing AWQ checkpoint (default: made and cached)")
    parser.add_argument("--eval-tokens", type=int, default=20480)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--requests", type=int, default=64, help="throughput workload size")
    parser.add_argument("--b1-repeats", type=int, default=3)
    parser.add_argument("--workdir", default="/tmp/kvgate-awq-bench")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "awq.json"))
    args = parser.parse_args()
    os.makedirs(args.workdir, exist_ok=True)

    from native_backend.loader import default_gguf_path

    paths = {"fp32": default_gguf_path(), "rtn": checkpoint_dir(args, "rtn"), "awq": checkpoint_dir(args, "awq")}
    paths["awq" + FP32_HEAD] = paths["awq"]  # what the int8 head costs
    rows = accuracy_rows(args, paths)
    if not args.skip_speed:
        for name, path in paths.items():
            if not name.endswith(FP32_HEAD):
                rows[name].update(speed(args, path))
    result = {"group_size": args.group_size, "eval_tokens": args.eval_tokens, "window": args.window,
              "threads": args.threads, "paths": paths, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print_table(rows)


def print_table(rows: dict[str, dict]) -> None:
    fp = rows["fp32"]
    print(f"{'':17} {'ppl':>8} {'vs fp32':>8} {'top-1 agree':>12} {'weights MiB':>12} {'linears MiB':>12} "
          f"{'b1 tok/s':>9} {'thrpt tok/s':>12}")
    for name, r in rows.items():
        b1, tp = r.get("b1_decode_tok_s"), r.get("throughput_out_tok_s")
        print(f"{name:17} {r['perplexity']:8.3f} {100 * (r['perplexity'] / fp['perplexity'] - 1):+7.1f}% "
              f"{100 * r['top1_agreement_with_fp32']:11.1f}% {r['weight_bytes'] / 2**20:12.1f} "
              f"{r['linear_weight_bytes'] / 2**20:12.1f} {b1 or float('nan'):9.1f} {tp or float('nan'):12.1f}")
    rtn, awq = rows.get("rtn"), rows.get("awq")
    if rtn and awq and rtn["perplexity"] > fp["perplexity"]:
        closed = (rtn["perplexity"] - awq["perplexity"]) / (rtn["perplexity"] - fp["perplexity"])
        print(f"AWQ closes {100 * closed:.0f}% of RTN's perplexity gap to fp32")


if __name__ == "__main__":
    main()
