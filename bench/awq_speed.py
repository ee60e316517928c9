"""The speed columns of bench/awq.py: fp32 and the int4 models side by side in one run, interleaved.

Each model gets a worker process that loads its engine once (the same engine settings for all, a
KV budget of --kv-mib) and then runs what the parent asks, one thing at a time across all workers:

- batch-1 decode: bench/engine_throughput.py's batch-1 prompts (128 tokens of pydoc_data.topics,
  128 new, greedy, EOS ignored), prompt r on every model before prompt r + 1, the order of the
  models rotated each round; decode-only rate = (new - 1) / (last token time - first token time);
  median over the prompts;
- C2: engine_throughput.py's workload (--requests requests, prompts 64-512 tokens, outputs 64-256,
  all added at once, step until done): output tok/s of wall time, each round on every model, rotated;
- TTFT (--ttft): time to the first token of one prompt of 128, 1,024 and 4,096 tokens (held-out
  `pydoc_data.topics` text, a fresh prompt each round so no prefix cache helps, the same prompt on
  every model of a round), llama.cpp included; median over --ttft-repeats rounds.

A box shared with other work moves absolute rates from one minute to the next; interleaving keeps
the models' ratios fair, and every measurement records the 1-minute load average when it started.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


TTFT_LENGTHS = (128, 1024, 4096)


def _worker(conn, path: str, overrides: dict, threads: int, kv_bytes: int) -> None:
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "bench"))
    import torch

    torch.set_num_threads(threads)
    from engine_runs import b1_numbers, kvgate_run

    from native_backend.config.cache_dir import tokenizer_cache_dir
    from native_backend.config.engine import EngineConfig
    from native_backend.process.factory import make_engine_core

    engine = make_engine_core(EngineConfig.build(path=path, num_threads=threads, **overrides,
                                                 tokenizer_cache_dir=str(tokenizer_cache_dir()),
                                                 kv_cache_bytes=kv_bytes))
    conn.send(engine.describe())
    while True:
        cmd = conn.recv()
        if cmd[0] == "stop":
            return
        if cmd[0] == "warmup":
            kvgate_run(engine, cmd[1], [8] * len(cmd[1]), "warmup-")
            conn.send(None)
        elif cmd[0] == "b1":
            run = kvgate_run(engine, [cmd[1]], [cmd[2]], f"b1-{time.monotonic_ns()}-")
            conn.send(b1_numbers(run["start"], run["times"][run["ids"][0]]))
        elif cmd[0] == "ttft":
            run = kvgate_run(engine, [cmd[1]], [1], f"ttft-{time.monotonic_ns()}-")
            conn.send({"ttft_s": run["times"][run["ids"][0]][0] - run["start"], "prompt_tokens": len(cmd[1])})
        elif cmd[0] == "c2":
            run = kvgate_run(engine, cmd[1], cmd[2], f"c2-{time.monotonic_ns()}-")
            out = sum(len(t) for t in run["tokens"].values())
            conn.send({"out_tokens": out, "wall_s": run["wall"], "out_tok_s": out / run["wall"],
                       "lengths_ok": [len(run["tokens"][r]) for r in run["ids"]] == list(cmd[2])})


LLAMA_CPP = "llama.cpp (Q4_1 GGUF)"  # the anchor row: batch-1 decode only


class _LlamaCpp:
    """bench/llamacpp_b1.py in llama.cpp's venv, answering the "b1" command as the workers do."""

    def __init__(self, python: str, gguf: str, threads: int):
        self.proc = subprocess.Popen([python, str(ROOT / "bench" / "llamacpp_b1.py"), gguf, str(threads)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.ready = self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"llama.cpp's worker exited ({self.proc.wait()})")
        return json.loads(line)

    def send(self, cmd) -> None:
        if cmd[0] == "b1":
            self.proc.stdin.write(json.dumps({"cmd": "b1", "prompt": list(cmd[1]), "new": cmd[2]}) + "\n")
        elif cmd[0] == "ttft":
            self.proc.stdin.write(json.dumps({"cmd": "ttft", "prompt": list(cmd[1])}) + "\n")
        elif cmd[0] == "c2":
            self.proc.stdin.write(json.dumps({"cmd": "c2", "prompts": cmd[1], "new": cmd[2]}) + "\n")
        elif cmd[0] == "stop":
            self.proc.stdin.write(json.dumps({"cmd": "stop"}) + "\n")
        self.proc.stdin.flush()

    def recv(self) -> dict:
        return self._read()

    def join(self, timeout: float) -> None:
        self.proc.wait(timeout)


def llama_cpp_python() -> str | None:
    """The python of llama.cpp's venv (bench/llamacpp_server.sh install), or None when not built."""
    out = subprocess.run(["bash", str(ROOT / "bench" / "llamacpp_server.sh"), "python"], capture_output=True,
                         text=True)
    return out.stdout.strip() or None


def measure(models: dict[str, tuple[str, dict]], args, llama_cpp: tuple[str, str] | None = None) -> dict[str, dict]:
    """models: row name -> (path, engine settings). Returns per row: b1_decode_tok_s, c2_out_tok_s,
    ttft_s by prompt length (--ttft) and every measurement with the load average it started under.
    llama_cpp: (its venv's python, the GGUF) adds the anchor row, batch-1 decode and TTFT only,
    interleaved with the others."""
    sys.path.insert(0, str(ROOT / "bench"))
    from engine_runs import build_workload

    w_args = argparse.Namespace(seed=0, requests=args.requests, prompt_min=64, prompt_max=512, output_min=64,
                                output_max=256, b1_prompt=128, b1_repeats=args.b1_repeats)
    workload = build_workload(w_args, next(iter(models.values()))[0])
    ctx = multiprocessing.get_context("spawn")
    workers = {}
    for name, (path, overrides) in models.items():
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_worker, args=(child, path, overrides, args.threads, args.kv_mib << 20))
        proc.start()
        workers[name] = (parent, proc)
    try:
        rows = {name: {"engine": conn.recv(), "b1_runs": [], "c2_runs": []} for name, (conn, _) in workers.items()}
        for conn, _ in workers.values():
            conn.send(("warmup", workload["warmup_prompts"]))
            conn.recv()
        names = list(models)
        if llama_cpp:
            anchor = _LlamaCpp(*llama_cpp, args.threads)
            workers[LLAMA_CPP] = (anchor, anchor)
            rows[LLAMA_CPP] = {"engine": {"llama.cpp": anchor.ready}, "b1_runs": [], "c2_runs": []}
            _timed(anchor, ("b1", workload["warmup_prompts"][0], 8))  # warm-up
            names.append(LLAMA_CPP)
        for r, prompt in enumerate(workload["b1_prompts"]):
            for name in names[r % len(names):] + names[:r % len(names)]:  # rotated each round
                rows[name]["b1_runs"].append(_timed(workers[name][0], ("b1", prompt, args.b1_new)))
                print(f"[{name}] b1 prompt {r}: {rows[name]['b1_runs'][-1]['decode_tok_s']:.1f} tok/s "
                      f"(load {rows[name]['b1_runs'][-1]['load_avg_1m']:.1f})", file=sys.stderr, flush=True)
        if getattr(args, "ttft", False):
            _ttft_rounds(rows, workers, names, _ttft_prompts(workload, args.ttft_repeats + 1))
        names = list(models)  # C2: the engines only
        for r in range(args.c2_repeats):
            for name in names[r % len(names):] + names[:r % len(names)]:
                run = _timed(workers[name][0], ("c2", workload["prompts"], workload["output_lens"]))
                rows[name]["c2_runs"].append(run)
                print(f"[{name}] C2 round {r}: {run['out_tok_s']:.1f} tok/s (load {run['load_avg_1m']:.1f})",
                      file=sys.stderr, flush=True)
    finally:
        for conn, proc in workers.values():
            try:
                conn.send(("stop",))
            except OSError:
                pass
            proc.join(30)
    for row in rows.values():
        row["b1_decode_tok_s"] = statistics.median(r["decode_tok_s"] for r in row["b1_runs"])
        row["c2_out_tok_s"] = statistics.median(r["out_tok_s"] for r in row["c2_runs"]) if row["c2_runs"] else None
        row["load_avg_1m"] = [r["load_avg_1m"] for r in row["b1_runs"] + row["c2_runs"]]
        if row.get("ttft_runs"):
            row["ttft_s"] = {str(n): statistics.median(r["ttft_s"] for r in row["ttft_runs"] if r["prompt_tokens"] == n)
                             for n in TTFT_LENGTHS}
    return rows


def _ttft_prompts(workload: dict, rounds: int) -> list[list[list[int]]]:
    """rounds x TTFT_LENGTHS prompts cut from the held-out tail of the text (never the same twice)."""
    from native_backend.config.cache_dir import tokenizer_cache_dir
    from native_backend.model.loader import default_gguf_path
    from native_backend.text.tokenizer import Tokenizer

    from kv_quant import held_out_ids

    tok = Tokenizer.from_pretrained(default_gguf_path(), cache_dir=str(tokenizer_cache_dir()))
    ids = held_out_ids(tok, rounds * sum(TTFT_LENGTHS))
    prompts, at = [], 0
    for _ in range(rounds):
        prompts.append([])
        for n in TTFT_LENGTHS:
            prompts[-1].append(ids[at:at + n])
            at += n
    return prompts


def _ttft_rounds(rows: dict, workers: dict, names: list[str], prompts: list[list[list[int]]]) -> None:
    """Round 0 warms every system up on its two shorter prompts (not counted); each round rotates
    the order of the systems."""
    for r, round_prompts in enumerate(prompts):
        for prompt in round_prompts[:2] if r == 0 else round_prompts:
            for name in names[r % len(names):] + names[:r % len(names)]:
                run = _timed(workers[name][0], ("ttft", prompt))
                if r:
                    rows[name].setdefault("ttft_runs", []).append(run)
                    print(f"[{name}] TTFT {len(prompt)} tokens: {run['ttft_s']:.3f} s (load {run['load_avg_1m']:.1f})",
                          file=sys.stderr, flush=True)


def _timed(conn, cmd) -> dict:
    load = os.getloadavg()[0]
    conn.send(cmd)
    return {**conn.recv(), "load_avg_1m": load}
