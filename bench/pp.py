"""Pipeline parallelism on this CPU: PP 1 against PP 2 (SmolLM2-135M, fp32), one run, side by side.

B requests (prompts of --prompt-len tokens of pydoc text, --new-tokens greedy tokens each, all
submitted at once) run through the engine core (LLMEngine: its scheduler and, at PP 2, its queue
of steps in flight) over one executor per configuration:

    PP 1                 one process, --threads torch threads, the one-call C decode step
    PP 2, k in flight    two stages of 15 layers (rank 0 in this process, rank 1 a worker), 1
                         thread each, the engine keeping up to k = 1, 2, 4 steps in flight
                         (executor.max_concurrent_batches; 2 is what the engine uses at PP 2)

Per configuration: output tokens/s (B x new tokens over the wall time of the whole run, prefill
included), and at PP 2 the bubble: the share of the two stages' time that is idle,
1 - (stage 0 busy + stage 1 busy) / (2 x wall), where a stage's busy time is its time computing
steps, not waiting for the other stage (executor.stage_busy_seconds). With one step in flight
the stages take turns (bubble near 1/2); with two, stage 0 computes step n + 1 while stage 1
finishes step n. The configurations are interleaved over --rounds rounds; each figure is the
median over rounds; every run must emit the same tokens (checked). On 2 shared cores two stages
of one thread each compete with everything else on the box: the point is correctness and that
the scheduling fills the bubble, not speed.

    .venv/bin/python bench/pp.py        # a few minutes; writes bench/results/pp.json
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


def build(pp: int, threads: int):
    from native_backend.config.cache_dir import tokenizer_cache_dir
    from native_backend.config.engine import EngineConfig
    from native_backend.execution.factory import make_executor
    from native_backend.model.loader import default_gguf_path

    config = EngineConfig.build(path=default_gguf_path(), pipeline_parallel_size=pp, num_threads=threads,
                                kv_cache_bytes=128 << 20, max_num_batched_tokens=256,
                                tokenizer_cache_dir=str(tokenizer_cache_dir()))
    return config, make_executor(config)


def prompts(batch: int, length: int) -> list[list[int]]:
    import pydoc_data.topics

    from native_backend.config.cache_dir import tokenizer_cache_dir
    from native_backend.model.loader import default_gguf_path
    from native_backend.text.tokenizer import Tokenizer

    ids = Tokenizer.from_pretrained(default_gguf_path(), cache_dir=tokenizer_cache_dir()).encode(
        " ".join(pydoc_data.topics.topics.values()))
    return [ids[i * length : (i + 1) * length] for i in range(batch)]


def run(config, executor, batch: list[list[int]], new_tokens: int, in_flight: int | None) -> dict:
    """Every prompt through a fresh engine over `executor`; wall time, tokens, and at PP > 1 the bubble."""
    from native_backend.core.engine import LLMEngine
    from native_backend.core.interface import EngineRequest
    from native_backend.core.sampling_params import SamplingParams

    if in_flight is not None:
        executor.max_concurrent_batches = in_flight
    engine = LLMEngine(config, executor)
    sampling = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    busy = executor.stage_busy_seconds() if in_flight is not None else None
    started = time.perf_counter()
    for i, prompt in enumerate(batch):
        engine.add_request(EngineRequest(f"q{i}", prompt, sampling))
    tokens = {f"q{i}": [] for i in range(len(batch))}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
    wall = time.perf_counter() - started
    row = dict(wall_s=wall, tok_s=len(batch) * new_tokens / wall, steps=engine.num_steps,
               tokens=[tokens[f"q{i}"] for i in range(len(batch))])
    if busy is not None:
        after = executor.stage_busy_seconds()
        stage_busy = [b - a for a, b in zip(busy, after)]
        row.update(stage_busy_s=stage_busy, bubble=1 - sum(stage_busy) / (len(stage_busy) * wall))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="PP 1's torch threads (each PP 2 stage: 1)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "pp.json"))
    args = parser.parse_args()
    batch = prompts(args.batch, args.prompt_len)
    single, pipelined = build(1, args.threads), build(2, 1)
    names = {"PP 1": (single, None), "PP 2, 1 in flight": (pipelined, 1), "PP 2, 2 in flight": (pipelined, 2),
             "PP 2, 4 in flight": (pipelined, 4)}
    rows: dict[str, list[dict]] = {name: [] for name in names}
    try:
        for _ in range(args.rounds):
            for name, ((config, executor), depth) in names.items():
                rows[name].append(run(config, executor, batch, args.new_tokens, depth))
    finally:
        pipelined[1].close()
    reference = rows["PP 1"][0]["tokens"]
    assert all(r["tokens"] == reference for runs in rows.values() for r in runs), "a configuration's tokens differ"
    summary = {}
    print(f"{args.batch} requests x {args.prompt_len} prompt + {args.new_tokens} output tokens, SmolLM2 fp32, "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"{'configuration':<20} {'output tok/s':>12} {'vs PP 1':>8} {'bubble':>7} {'steps':>6}")
    base = statistics.median(r["tok_s"] for r in rows["PP 1"])
    for name, runs in rows.items():
        tok_s = statistics.median(r["tok_s"] for r in runs)
        bubble = statistics.median(r["bubble"] for r in runs) if "bubble" in runs[0] else None
        summary[name] = dict(tok_s=tok_s, ratio=tok_s / base, bubble=bubble, steps=runs[0]["steps"],
                             runs=[{k: v for k, v in r.items() if k != "tokens"} for r in runs])
        shown = f"{bubble:.2f}" if bubble is not None else "-"
        print(f"{name:<20} {tok_s:>12.1f} {tok_s / base:>7.2f}x {shown:>7} {runs[0]['steps']:>6}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(args=vars(args), load_average=os.getloadavg(), results=summary),
                                         indent=2) + "\n")


if __name__ == "__main__":
    main()
