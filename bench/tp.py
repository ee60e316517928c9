"""Tensor parallelism on this CPU: TP 1 against TP 3 (SmolLM2-135M, fp32), one run, side by side.

For batch 1 and batch 32: B prompts of --prompt-len tokens (pydoc text) are prefilled (untimed),
then --steps greedy decode steps are timed one by one through the executor (`execute`: inputs,
forward, LM head, sampling on rank 0; TP 3 also sends each step's delta to its two workers).
Per configuration and batch: the median step time, output tokens/s (B tokens per step), and for
TP 3 the time rank 0 spends inside collectives per step (30 layers x 2 all-reduces + the
embedding's + the LM head's gather = 62 per step; it includes waiting for the slowest rank) and
the bytes they move. The two executors are interleaved over --rounds rounds (A B A B) and each
figure is the median over rounds; both emit the same tokens (checked).

TP 1 runs with --tp1-threads torch threads and its one-call C decode step; each TP 3 rank runs
1 thread (3 processes on 2 cores) and the per-layer path. On a shared, oversubscribed box use 1
for TP 1 too: OpenMP's spin barriers with 2 threads then cost seconds a step whenever one thread
is descheduled. Last, the cost of one all-reduce alone (3 idle processes, 200 calls), to tell
the collective's own cost from the waits for a rank that has no core. On a 2-core CPU, TP can
only lose: it is here to show where the time goes, not to speed anything up.

    .venv/bin/python bench/tp.py --tp1-threads 1   # about 5 minutes; writes bench/results/tp.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def build(tp: int, threads: int):
    from native_backend.config.cache_dir import tokenizer_cache_dir
    from native_backend.config.engine import EngineConfig
    from native_backend.execution.factory import make_executor
    from native_backend.model.loader import default_gguf_path

    config = EngineConfig.build(path=default_gguf_path(), tensor_parallel_size=tp, num_threads=threads,
                                kv_cache_bytes=256 << 20, tokenizer_cache_dir=str(tokenizer_cache_dir()))
    return make_executor(config)


def prompts(batch: int, length: int) -> list[list[int]]:
    import pydoc_data.topics

    from native_backend.config.cache_dir import tokenizer_cache_dir
    from native_backend.model.loader import default_gguf_path
    from native_backend.text.tokenizer import Tokenizer

    ids = Tokenizer.from_pretrained(default_gguf_path(), cache_dir=tokenizer_cache_dir()).encode(
        " ".join(pydoc_data.topics.topics.values()))
    return [ids[i * length : (i + 1) * length] for i in range(batch)]


def run(executor, batch_prompts: list[list[int]], steps: int, threads: int) -> dict:
    """Prefill, then `steps` timed decode steps; per-step wall and collective seconds."""
    import torch

    from native_backend.core.batch import ScheduledChunk, SchedulerOutput
    from native_backend.core.sampling_params import SamplingParams

    torch.set_num_threads(threads)
    greedy, block = SamplingParams(temperature=0.0), 16
    blocks_each = -(-(len(batch_prompts[0]) + steps + 1) // block)
    tables = [list(range(1 + i * blocks_each, 1 + (i + 1) * blocks_each)) for i in range(len(batch_prompts))]
    ids = [f"b{i}" for i in range(len(batch_prompts))]
    out = executor.execute(SchedulerOutput([ScheduledChunk(r, p, 0, t, True, greedy)
                                            for r, p, t in zip(ids, batch_prompts, tables)]))
    tokens = {r: [out.sampled_token_ids[r][0]] for r in ids}
    comm = getattr(executor, "comm", None)
    walls, collectives, calls, nbytes = [], [], [], []
    for step in range(steps):
        chunks = [ScheduledChunk(r, [tokens[r][-1]], len(p) + step, t, True, greedy)
                  for r, p, t in zip(ids, batch_prompts, tables)]
        before = (comm.seconds, comm.calls, comm.bytes) if comm else (0.0, 0, 0)
        started = time.perf_counter()
        out = executor.execute(SchedulerOutput(chunks, finished_request_ids=[]))
        walls.append(time.perf_counter() - started)
        if comm:
            collectives.append(comm.seconds - before[0])
            calls.append(comm.calls - before[1])
            nbytes.append(comm.bytes - before[2])
        for r in ids:
            tokens[r].append(out.sampled_token_ids[r][0])
    finished = SchedulerOutput([], finished_request_ids=ids)
    executor.execute(finished)
    row = dict(step_ms=statistics.median(walls) * 1e3, tok_s=len(ids) / statistics.median(walls), tokens=tokens)
    if comm:
        row.update(collective_ms=statistics.median(collectives) * 1e3, collectives_per_step=statistics.median(calls),
                   collective_bytes_per_step=statistics.median(nbytes))
    return row


def allreduce_latency(size: int, numel: int, iters: int) -> float:
    """Median seconds of one gloo all-reduce of `numel` float32 among `size` fresh processes on
    loopback, nothing else running in them: the collective's own cost, apart from the waits for
    a rank that the step's all-reduces also include."""
    import multiprocessing

    from native_backend.execution.parallel.group import open_rendezvous

    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    with open_rendezvous() as listener:  # rank 0's store takes over a copy of it
        port = listener.getsockname()[1]
        procs = [ctx.Process(target=_allreduce_rank,
                             args=(r, size, port, numel, iters, results, listener if r == 0 else None))
                 for r in range(size)]
        for p in procs:
            p.start()
    latency = results.get(timeout=600)
    for p in procs:
        p.join(60)
    return latency


def _allreduce_rank(rank: int, size: int, port: int, numel: int, iters: int, results, listener) -> None:
    import torch
    import torch.distributed as dist

    from native_backend.execution.parallel.group import join_group

    torch.set_num_threads(1)
    join_group(rank, size, port, torch.device("cpu"), 60, listener)
    x, times = torch.ones(numel), []
    for _ in range(iters + 10):
        started = time.perf_counter()
        dist.all_reduce(x)
        times.append(time.perf_counter() - started)
    if rank == 0:
        results.put(statistics.median(times[10:]))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--tp1-threads", type=int, default=2)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "tp.json"))
    args = parser.parse_args()

    one, three = build(1, args.tp1_threads), build(3, 1)
    print(three.describe())
    results = {}
    try:
        for batch in (1, 32):
            batch_prompts = prompts(batch, args.prompt_len)
            rounds = {"tp1": [], "tp3": []}
            loads = []
            run(one, batch_prompts, 2, args.tp1_threads)  # warm-up (untimed)
            run(three, batch_prompts, 2, 1)
            for _ in range(args.rounds):
                rounds["tp1"].append(run(one, batch_prompts, args.steps, args.tp1_threads))
                rounds["tp3"].append(run(three, batch_prompts, args.steps, 1))
                loads.append(os.getloadavg()[0])
            same = all(a["tokens"] == b["tokens"] for a, b in zip(rounds["tp1"], rounds["tp3"]))
            results[f"batch_{batch}"] = summarize(rounds, same, loads)
            print_rows(batch, results[f"batch_{batch}"])
    finally:
        three.close()
    hidden = 576
    for batch in (1, 32):
        seconds = allreduce_latency(3, batch * hidden, 200)
        results[f"batch_{batch}"]["gloo_allreduce_alone_ms"] = seconds * 1e3
        print(f"batch {batch:2d}: one gloo all-reduce of {batch} x {hidden} floats among 3 idle processes: "
              f"{seconds * 1e3:.2f} ms (x 61 per step = {61 * seconds * 1e3:.1f} ms)")
    results["setup"] = dict(model="SmolLM2-135M-Instruct fp32 (GGUF Q4_1 dequantized)", steps=args.steps,
                            rounds=args.rounds, prompt_len=args.prompt_len, tp1_threads=args.tp1_threads,
                            tp3_threads_per_rank=1, cores=os.cpu_count(), tok_s="output tokens per second")
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")


def summarize(rounds: dict, same: bool, loads: list[float]) -> dict:
    def med(name, key):
        return statistics.median(r[key] for r in rounds[name])

    row = {name: {k: med(name, k) for k in rounds[name][0] if k != "tokens"} for name in rounds}
    row["tp3_over_tp1_step_time"] = statistics.median(
        b["step_ms"] / a["step_ms"] for a, b in zip(rounds["tp1"], rounds["tp3"]))
    row["same_tokens"] = same
    row["load_average"] = statistics.median(loads)
    return row


def print_rows(batch: int, row: dict) -> None:
    tp1, tp3 = row["tp1"], row["tp3"]
    print(f"batch {batch:2d}: TP1 {tp1['step_ms']:7.1f} ms/step {tp1['tok_s']:7.1f} tok/s | TP3 {tp3['step_ms']:7.1f} "
          f"ms/step {tp3['tok_s']:7.1f} tok/s, in collectives {tp3['collective_ms']:6.1f} ms/step "
          f"({tp3['collectives_per_step']:.0f} calls, {tp3['collective_bytes_per_step'] / 1024:.0f} KiB) | "
          f"TP3/TP1 step time {row['tp3_over_tp1_step_time']:.2f}x | same tokens {row['same_tokens']} | "
          f"load {row['load_average']:.1f}")


if __name__ == "__main__":
    main()
