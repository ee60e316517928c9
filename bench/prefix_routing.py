"""Routing by cached prefix: prefix-cache hit rate and TTFT of three chat workloads over three
native engines, for round_robin, least_loaded, prefix_affinity and precise_prefix, one run.

Setup: `configs/prefix_routing.yaml` (SmolLM2-135M-Instruct, three native engines on loopback,
one torch thread each, KV events on tcp://) served by `kvgate serve` in a subprocess. The policy
is switched by rewriting the config and sending SIGHUP (a hot reload keeps the engines: only the
pool's policy changes), so every policy runs against the same three engine processes. Last, a
reload leaves one engine alone, whose hit rate is the "one engine serving everything" reference.

Workloads (`--workloads`, fixed seeds; every policy runs each, side by side in one run):

multi_turn: `--systems` system prompts (pydoc text, ~`--system-tokens` tokens each),
`--users` conversations spread over them, `--turns` turns each: a user message (pydoc text), the
model's reply (`--max-tokens`, greedy) appended (a question is `--question-words` words of pydoc text), the next turn sent with the whole history.
Requests go turn by turn, users interleaved in a new random order each turn, `--concurrency` in
flight. Every phase (policy) gets
conversations of its own (other pydoc passages), so no phase reuses another's cache; a warm-up
phase fills the caches first, so every measured phase starts with full LRUs.

shared_system: one application's shape (issue 44). `--shared-users` conversations, all in flight
at once, share ONE system prompt of ~`--shared-system-tokens` tokens; each goes through
`--shared-turns` turns on its own (its next turn as soon as its answer is in, no barrier), so a
conversation's turn 2 may arrive before turn 1's KV events.

random: no shared prefix at all: `--random-requests` single-turn requests, each a fresh passage
of `--random-words` words, `--concurrency` in flight (routing by prefix must not cost here).

Measured per phase: hit rate = prompt tokens found in the prefix cache / prompt tokens looked up,
from the engines' own counters (vllm:prefix_cache_hits / _queries on /metrics, summed over the
engines, deltas over the phase); TTFT p50/p99 (first streamed content chunk - request sent).

    .venv/bin/python bench/prefix_routing.py              # about 10 minutes on 2 busy cores
    .venv/bin/python bench/prefix_routing.py --quick      # fewer users and turns
    .venv/bin/python bench/prefix_routing.py --workloads shared_system,random --policies precise_prefix,least_loaded
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
WORKLOADS = ("multi_turn", "shared_system", "random")
# policies under another name with options of their own (--policies may name them)
VARIANTS = {"precise_prefix_shared": ("precise_prefix", {"shared_compute": True}),
            "precise_prefix_blend": ("precise_prefix", {"cost_model": False})}  # the pre-cost-model score
WORKLOAD_DEFAULTS = {"--systems": 3, "--system-tokens": 300, "--question-words": 90, "--users": 12, "--turns": 4,
                     "--max-tokens": 16, "--concurrency": 4, "--shared-users": 8, "--shared-turns": 4,
                     "--shared-system-tokens": 500, "--random-requests": 24, "--random-words": 200}


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


async def run_phase(base: str, phase: int, workload: str, args) -> list[float]:
    if workload == "shared_system":
        return await run_shared_system(base, phase, args)
    if workload == "random":
        return await run_random(base, phase, args)
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


async def run_shared_system(base: str, phase: int, args) -> list[float]:
    """`--shared-users` conversations at once on one system prompt, each turn after its own last."""
    system = passages(3000 + phase, 1, int(args.shared_system_tokens * 0.75))[0]
    questions = passages(4000 + phase, args.shared_users * args.shared_turns, args.question_words)
    ttfts: list[float] = []
    async with httpx.AsyncClient(timeout=600) as client:
        async def conversation(u: int) -> None:
            history = [{"role": "system", "content": f"You are a helpful assistant. Reference:\n{system}"}]
            for turn in range(args.shared_turns):
                question = "Question: " + questions[u * args.shared_turns + turn]
                ttfts.append(await one_turn(client, base, history, question, args))
        await asyncio.gather(*(conversation(u) for u in range(args.shared_users)))
    return ttfts


async def run_random(base: str, phase: int, args) -> list[float]:
    """Single-turn prompts that share nothing but the chat template's first tokens."""
    prompts = passages(5000 + phase, args.random_requests, args.random_words)
    ttfts: list[float] = []
    limit = asyncio.Semaphore(args.concurrency)
    async with httpx.AsyncClient(timeout=600) as client:
        async def go(text: str) -> None:
            async with limit:
                ttfts.append(await one_turn(client, base, [{"role": "system", "content": text}], "Summarise.", args))
        await asyncio.gather(*(go(t) for t in prompts))
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
    policy, options = VARIANTS.get(policy, (policy, {}))
    model["policy"] = policy
    if policy != "precise_prefix":
        model["policy_options"] = {}
    else:  # every decision on the status page: the row keeps the last ones (matched tokens, estimates)
        model["policy_options"].update(options, route_sample_every=1)
    model["deployments"] = model["deployments"][:deployments]
    path.write_text(yaml.safe_dump(config, sort_keys=False))


def reload(proc, base: str, path: Path, policy: str, deployments: int = 3) -> None:
    write_config(path, policy, deployments)
    proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        model = httpx.get(base + "/status.json", timeout=10).json()["models"][0]
        if model["policy"] == VARIANTS.get(policy, (policy,))[0] and len(model["deployments"]) == deployments:
            time.sleep(1.0)  # precise_prefix's subscribers connect
            return
        time.sleep(0.2)
    raise RuntimeError(f"the reload to {policy} did not apply")


def measure(proc, base: str, path: Path, name: str, policy: str, phase: int, args, deployments: int = 3,
            workload: str = "multi_turn") -> dict:
    reload(proc, base, path, policy, deployments)
    hits0, queries0 = prefix_counters(base)
    started = time.perf_counter()
    ttfts = asyncio.run(run_phase(base, phase, workload, args))
    elapsed = time.perf_counter() - started
    hits, queries = prefix_counters(base)
    row = {"workload": workload, "name": name, "policy": policy, "engines": deployments, "requests": len(ttfts),
           "hit_rate": (hits - hits0) / max(queries - queries0, 1), "prompt_tokens": queries - queries0,
           "ttft_p50_ms": 1000 * percentile(ttfts, 50), "ttft_p99_ms": 1000 * percentile(ttfts, 99),
           "seconds": elapsed, "load_avg": os.getloadavg()[0]}
    if policy.startswith("precise_prefix"):
        row["recent_routes"] = httpx.get(base + "/status.json", timeout=10).json()["models"][0].get("recent_routes")
    print(f"  {workload:<13} {name:<18} hit rate {row['hit_rate']:6.1%}   TTFT p50 {row['ttft_p50_ms']:8.1f} ms   "
          f"p99 {row['ttft_p99_ms']:8.1f} ms   ({row['requests']} requests, {elapsed:.0f} s, "
          f"load {row['load_avg']:.1f})", flush=True)
    return row


def summarise(rows: list[dict]) -> dict:
    """Per workload: precise_prefix's TTFT p50 over the best other policy's (the issue's goal on
    shared_system: <= 0.67), its hit rate, and round robin's p50 over its own (multi_turn)."""
    summary = {}
    for workload in dict.fromkeys(r["workload"] for r in rows):
        by = {r["name"]: r for r in rows if r["workload"] == workload}
        precise = by.get("precise_prefix")
        others = [r for n, r in by.items() if n in POLICIES and n != "precise_prefix"]
        if precise is None or not others:
            continue
        best = min(others, key=lambda r: r["ttft_p50_ms"])
        s = {"precise_hit_rate": precise["hit_rate"], "best_other": best["name"],
             "precise_p50_over_best_other": precise["ttft_p50_ms"] / best["ttft_p50_ms"]}
        if "round_robin" in by:
            s["p50_speedup_vs_round_robin"] = by["round_robin"]["ttft_p50_ms"] / precise["ttft_p50_ms"]
        if "least_loaded" in by:
            s["p50_over_least_loaded"] = precise["ttft_p50_ms"] / by["least_loaded"]["ttft_p50_ms"]
        summary[workload] = s
        print(f"{workload}: precise_prefix hit rate {s['precise_hit_rate']:.1%}, TTFT p50 "
              f"{s['precise_p50_over_best_other']:.2f}x the best other's ({best['name']})"
              + (f", {s['p50_speedup_vs_round_robin']:.2f}x faster than round robin" if "round_robin" in by else ""))
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for flag, default in WORKLOAD_DEFAULTS.items():
        parser.add_argument(flag, type=int, default=default)
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated, of " + ", ".join(WORKLOADS))
    parser.add_argument("--policies", default=",".join(POLICIES),
                        help="comma-separated, of " + ", ".join((*POLICIES, *VARIANTS)))
    parser.add_argument("--one-engine", action="store_true", help="multi_turn on one engine alone too (reference)")
    parser.add_argument("--quick", action="store_true", help="6 users, 3 turns")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "prefix_routing.json")
    args = parser.parse_args()
    if args.quick:
        args.users, args.turns = 6, 3
    workloads, policies = args.workloads.split(","), args.policies.split(",")
    unknown = (set(workloads) - set(WORKLOADS)) | (set(policies) - set(POLICIES) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown workload or policy: {', '.join(sorted(unknown))}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvgate-prefix-routing-") as tmp:
        path, port = Path(tmp) / "config.yaml", free_port()
        base = f"http://127.0.0.1:{port}"
        write_config(path, "round_robin")
        kvgate = Path(sys.executable).with_name("kvgate")
        proc = spawn([str(kvgate), "serve", "--config", str(path), "--port", str(port)], base + "/health/ready",
                     timeout=900)
        try:
            print(f"multi_turn {args.users} users x {args.turns} turns over {args.systems} system prompts, "
                  f"{args.concurrency} in flight; shared_system {args.shared_users} users x {args.shared_turns} "
                  f"turns on one ~{args.shared_system_tokens}-token system prompt; random {args.random_requests} "
                  f"x {args.random_words} words; {args.max_tokens} new tokens per turn", flush=True)
            measure(proc, base, path, "(warm-up)", "round_robin", 0, args)
            phase = 1
            for workload in workloads:
                for p in policies:
                    rows.append(measure(proc, base, path, p, p, phase, args, workload=workload))
                    phase += 1
            if args.one_engine and "multi_turn" in workloads:
                rows.append(measure(proc, base, path, "one engine alone", "round_robin", phase, args, 1))
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    summary = summarise(rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows,
                                    "summary": summary}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
