"""Routing by cached prefix: prefix-cache hit rate and TTFT of a multi-turn chat workload over
three native engines, for round_robin, least_loaded, prefix_affinity and precise_prefix, one run.

Setup: `configs/prefix_routing.yaml` (SmolLM2-135M-Instruct, three native engines on loopback,
one torch thread each, KV events on tcp://) served by `kvgate serve` in a subprocess. The policy
is switched by rewriting the config and sending SIGHUP (a hot reload keeps the engines: only the
pool's policy changes), so every policy runs against the same three engine processes. Last, a
reload leaves one engine alone, whose hit rate is the "one engine serving everything" reference.

Workload (fixed seed): `--systems` system prompts (pydoc text, ~`--system-tokens` tokens each),
`--users` conversations spread over them, `--turns` turns each: a user message (pydoc text), the
model's reply (`--max-tokens`, greedy) appended (a question is `--question-words` words of pydoc text), the next turn sent with the whole history.
Requests go turn by turn, users interleaved in a new random order each turn, `--concurrency` in
flight. Every phase (policy) gets
conversations of its own (other pydoc passages), so no phase reuses another's cache; a warm-up
phase fills the caches first, so every measured phase starts with full LRUs.

Measured per phase: hit rate = prompt tokens found in the prefix cache / prompt tokens looked up,
from the engines' own counters (vllm:prefix_cache_hits / _queries on /metrics, summed over the
engines, deltas over the phase); TTFT p50/p99 (first streamed content chunk - request sent).

    .venv/bin/python bench/prefix_routing.py              # about 10 minutes on 2 busy cores
    .venv/bin/python bench/prefix_routing.py --quick      # fewer users and turns
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]
from tests.support.servers.loopback import free_port  # noqa: E402
from serve_metrics import percentile  # noqa: E402
from upstream_overhead import spawn  # noqa: E402

CONFIG = ROOT / "configs" / "prefix_routing.yaml"
MODEL = "smollm2-135m-instruct"
POLICIES = ("round_robin", "least_loaded", "prefix_affinity", "precise_prefix")
WORKLOAD_DEFAULTS = {"--systems": 3, "--system-tokens": 300, "--question-words": 90, "--users": 12, "--turns": 4,
                     "--max-tokens": 16, "--concurrency": 4}


def passages(seed: int, count: int, words: int) -> list[str]:
    """`count` passages of about `words` words of Python's own documentation."""
    from pydoc_data.topics import topics

    text = " ".join(" ".join(topics[k].split()) for k in sorted(topics)).split()
    rng = random.Random(seed)
    starts = rng.sample(range(len(text) - words), count)
    return [" ".join(text[s:s + words]) for s in starts]


def conversations(phase: int, args) -> list[list[dict]]:
    """Each user's opening history: one of the phase's system prompts, shared by several users."""
    systems = passages(1000 + phase, args.systems, int(args.system_tokens * 0.75))
    return [[{"role": "system", "content": f"You are a helpful assistant. Reference:\n{systems[u % args.systems]}"}]
            for u in range(args.users)]


async def one_turn(client: httpx.AsyncClient, base: str, history: list[dict], question: str, args) -> float:
    """Send the next turn; append question and answer to `history`; return the TTFT in seconds."""
    history.append({"role": "user", "content": question})
    body = {"model": MODEL, "messages": history, "max_tokens": args.max_tokens, "temperature": 0, "stream": True}
    started, ttft, answer = time.perf_counter(), None, []
    async with client.stream("POST", base + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            delta = json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
            if delta and ttft is None:
                ttft = time.perf_counter() - started
            answer.append(delta)
    history.append({"role": "assistant", "content": "".join(answer)})
    return ttft if ttft is not None else time.perf_counter() - started


async def run_phase(base: str, phase: int, args) -> list[float]:
    histories = conversations(phase, args)
    questions = passages(2000 + phase, args.users * args.turns, args.question_words)
    ttfts: list[float] = []
    limit = asyncio.Semaphore(args.concurrency)
    order = random.Random(phase)
    async with httpx.AsyncClient(timeout=600) as client:
        for turn in range(args.turns):  # users interleaved within a turn; turn t+1 after turn t
            async def go(u: int) -> None:
                async with limit:
                    ttfts.append(await one_turn(client, base, histories[u], "Question: " +
                                                questions[turn * args.users + u], args))
            # A new order each turn: in a fixed one, round robin over a multiple of the engine
            # count would send each user to the same engine every turn (affinity by accident).
            users = order.sample(range(args.users), args.users)
            await asyncio.gather(*(go(u) for u in users))
    return ttfts


def prefix_counters(base: str) -> tuple[float, float]:
    """(hits, queries) summed over the engines, from /metrics."""
    text = httpx.get(base + "/metrics", timeout=30).text
    def total(name: str) -> float:
        return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:_total)?{{[^}}]*}} (\S+)$", text, re.M))
    return total("vllm:prefix_cache_hits"), total("vllm:prefix_cache_queries")


def write_config(path: Path, policy: str, deployments: int = 3) -> None:
    config = yaml.safe_load(CONFIG.read_text())
    model = config["models"][0]
    model["policy"] = policy
    if policy != "precise_prefix":
        model["policy_options"] = {}
    model["deployments"] = model["deployments"][:deployments]
    path.write_text(yaml.safe_dump(config, sort_keys=False))


def reload(proc, base: str, path: Path, policy: str, deployments: int = 3) -> None:
    write_config(path, policy, deployments)
    proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        model = httpx.get(base + "/status.json", timeout=10).json()["models"][0]
        if model["policy"] == policy and len(model["deployments"]) == deployments:
            time.sleep(1.0)  # precise_prefix's subscribers connect
            return
        time.sleep(0.2)
    raise RuntimeError(f"the reload to {policy} did not apply")


def measure(proc, base: str, path: Path, name: str, policy: str, phase: int, args, deployments: int = 3) -> dict:
    reload(proc, base, path, policy, deployments)
    hits0, queries0 = prefix_counters(base)
    started = time.perf_counter()
    ttfts = asyncio.run(run_phase(base, phase, args))
    elapsed = time.perf_counter() - started
    hits, queries = prefix_counters(base)
    row = {"name": name, "policy": policy, "engines": deployments, "requests": len(ttfts),
           "hit_rate": (hits - hits0) / max(queries - queries0, 1), "prompt_tokens": queries - queries0,
           "ttft_p50_ms": 1000 * percentile(ttfts, 50), "ttft_p99_ms": 1000 * percentile(ttfts, 99),
           "seconds": elapsed, "load_avg": os.getloadavg()[0]}
    print(f"  {name:<18} hit rate {row['hit_rate']:6.1%}   TTFT p50 {row['ttft_p50_ms']:8.1f} ms   "
          f"p99 {row['ttft_p99_ms']:8.1f} ms   ({row['requests']} requests, {elapsed:.0f} s)", flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for flag, default in WORKLOAD_DEFAULTS.items():
        parser.add_argument(flag, type=int, default=default)
    parser.add_argument("--quick", action="store_true", help="6 users, 3 turns")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "prefix_routing.json")
    args = parser.parse_args()
    if args.quick:
        args.users, args.turns = 6, 3
    with tempfile.TemporaryDirectory(prefix="kvgate-prefix-routing-") as tmp:
        path, port = Path(tmp) / "config.yaml", free_port()
        base = f"http://127.0.0.1:{port}"
        write_config(path, "round_robin")
        kvgate = Path(sys.executable).with_name("kvgate")
        proc = spawn([str(kvgate), "serve", "--config", str(path), "--port", str(port)], base + "/health/ready",
                     timeout=900)
        try:
            print(f"{args.users} users x {args.turns} turns over {args.systems} system prompts, "
                  f"{args.concurrency} in flight, {args.max_tokens} new tokens per turn", flush=True)
            measure(proc, base, path, "(warm-up)", "round_robin", 0, args)
            rows = [measure(proc, base, path, p, p, i + 1, args) for i, p in enumerate(POLICIES)]
            rows.append(measure(proc, base, path, "one engine alone", "round_robin", len(POLICIES) + 1, args, 1))
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    by = {r["name"]: r for r in rows}
    precise, alone = by["precise_prefix"], by["one engine alone"]
    summary = {"hit_rate_vs_one_engine": precise["hit_rate"] / max(alone["hit_rate"], 1e-9),
               "ttft_p50_speedup_vs_round_robin": by["round_robin"]["ttft_p50_ms"] / precise["ttft_p50_ms"],
               "ttft_p99_vs_least_loaded": precise["ttft_p99_ms"] / by["least_loaded"]["ttft_p99_ms"]}
    print(f"precise_prefix: hit rate {summary['hit_rate_vs_one_engine']:.2f} of one engine's (goal >= 0.90); "
          f"TTFT p50 {summary['ttft_p50_speedup_vs_round_robin']:.2f}x round robin's (goal >= 1.5x); "
          f"p99 {summary['ttft_p99_vs_least_loaded']:.2f}x least_loaded's (goal <= 1.0)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows,
                                    "summary": summary}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
