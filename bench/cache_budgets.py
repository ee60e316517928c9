"""The response cache's and the budgets' costs and guarantees, measured side by side in one run.

cache:     bench/bare_server.py (a fixed 16-chunk upstream) behind three models of one `kvgate serve`
           (openai backend): `echo` without a cache, `echo-mem` and `echo-redis` with one (scope
           shared), and bench/bare_relay.py (the same hop with no gateway logic). Greedy
           /v1/completions, whole and streamed. At concurrency 1 the targets take turns request by
           request (rounds), so load drift hits all alike: a hit's p50 against the same gateway's
           uncached p50 is what a hit adds (negative: it saves the upstream). At concurrency 32 the
           targets take turns run by run: hits' requests/s as a share of the bare relay's.
budgets:   admission overhead: one gateway per store (memory, redis), an echo model, two keys, one
           with a (never-reached) budget and one with none; turns request by request at c=1; the
           p50 difference is the reservation plus the settle. No-overrun: two gateways sharing a
           Redis, a team budget of K tokens, waves of 64 concurrent streams (half cut by the client
           after 3 chunks) until every request is refused; spend (GET /key/info) must be <= K and
           equal to the usage the clients were shown plus what the cut streams streamed.

    .venv/bin/python bench/cache_budgets.py [--rounds 300] [--total 2000] [--repeats 3] [--k 3000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from tests.support.servers.loopback import free_port  # noqa: E402
from tests.support.servers.redis_server import RedisServer  # noqa: E402
from upstream_overhead import spawn  # noqa: E402

KEY, FREE_KEY = "sk-bench-budgeted-0123456789", "sk-bench-free-0123456789"
PROMPT = "the quick brown fox jumps over the lazy dog " * 4
CACHE_CONFIG = """
server: {{log_level: warning}}
auth: {{limits_store: {{kind: redis, url_env: BENCH_REDIS_URL}}}}
models:
  - {{name: echo, deployments: [{{name: u0, backend: openai, settings: {{base_url: "{up}/v1", metrics: none}}}}]}}
  - name: echo-mem
    cache: {{scope: shared}}
    deployments: [{{name: u1, backend: openai, settings: {{base_url: "{up}/v1", metrics: none}}}}]
  - name: echo-redis
    cache: {{scope: shared, store: redis}}
    deployments: [{{name: u2, backend: openai, settings: {{base_url: "{up}/v1", metrics: none}}}}]
"""
BUDGET_CONFIG = """
server: {{log_level: warning}}
auth:
  limits_store: {store}
  keys:
    - {{name: budgeted, key_env: BENCH_KEY, team: bench}}
    - {{name: free, key_env: BENCH_FREE_KEY}}
budgets:
  limits: [{{name: team-day, team: bench, limit: {k}, window: day}}]
models:
  - name: echo
    queue: {{max_size: 1024}}
    deployments: [{{name: e0, backend: echo, settings: {{tokens_per_second: {tps}}}}}]
"""


def gateway(workdir: Path, name: str, text: str, env: dict):
    path = workdir / f"{name}.yaml"
    path.write_text(text)
    port = free_port()
    proc = spawn([sys.executable, "-m", "gateway.cli", "serve", "--config", str(path), "--port", str(port)],
                 f"http://127.0.0.1:{port}/health/ready", env=env)
    return proc, f"http://127.0.0.1:{port}"


async def timed(client: httpx.AsyncClient, base: str, body: dict, key: str = KEY) -> float:
    start = time.perf_counter()
    headers = {"authorization": f"Bearer {key}"}
    if body.get("stream"):
        async with client.stream("POST", base + "/v1/completions", json=body, headers=headers) as r:
            r.raise_for_status()
            async for _ in r.aiter_bytes():
                pass
    else:
        (await client.post(base + "/v1/completions", json=body, headers=headers)).raise_for_status()
    return time.perf_counter() - start


def body(model: str, stream: bool) -> dict:
    return {"model": model, "prompt": PROMPT, "max_tokens": 16, "temperature": 0, "stream": stream}


async def turns_at_c1(targets: dict[str, tuple], rounds: int) -> dict[str, float]:
    """p50 ms of each target, taking turns request by request (targets: name -> (base, body, key))."""
    times: dict[str, list[float]] = {n: [] for n in targets}
    async with httpx.AsyncClient(timeout=60) as client:
        for base, b, key in targets.values():  # warm-up, and the cached models' entries
            for _ in range(5):
                await timed(client, base, b, key)
        for _ in range(rounds):
            for name, (base, b, key) in targets.items():
                times[name].append(await timed(client, base, b, key))
    return {n: 1000 * statistics.median(t) for n, t in times.items()}


async def rps_at_c32(base: str, b: dict, total: int) -> float:
    limits = httpx.Limits(max_connections=32, max_keepalive_connections=32)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:
        await asyncio.gather(*(timed(client, base, b) for _ in range(32)))
        left = [total]

        async def worker():
            while left[0] > 0:
                left[0] -= 1
                await timed(client, base, b)
        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(32)))
        return total / (time.perf_counter() - start)


def cache_bench(workdir: Path, redis: RedisServer, args) -> dict:
    up_port, relay_port = free_port(), free_port()
    upstream = f"http://127.0.0.1:{up_port}"
    procs = [spawn([sys.executable, str(ROOT / "bench/bare_server.py"), str(up_port), "16"],
                   upstream + "/health/ready")]
    relay = f"http://127.0.0.1:{relay_port}"
    procs.append(spawn([sys.executable, str(ROOT / "bench/bare_relay.py"), str(relay_port), upstream],
                       relay + "/health/ready"))
    proc, gw = gateway(workdir, "cache", CACHE_CONFIG.format(up=upstream), {"BENCH_REDIS_URL": redis.url})
    procs.append(proc)
    out = {}
    try:
        for stream in (False, True):
            kind = "stream" if stream else "whole"
            targets = {"relay": (relay, body("echo", stream), KEY), "kvgate": (gw, body("echo", stream), KEY),
                       "hit-memory": (gw, body("echo-mem", stream), KEY),
                       "hit-redis": (gw, body("echo-redis", stream), KEY)}
            c1 = asyncio.run(turns_at_c1(targets, args.rounds))
            rps: dict[str, list[float]] = {n: [] for n in targets}
            for _ in range(args.repeats):
                for name, (base, b, _) in targets.items():
                    rps[name].append(asyncio.run(rps_at_c32(base, b, args.total)))
            c32 = {n: statistics.median(v) for n, v in rps.items()}
            out[kind] = {"c1_p50_ms": c1, "c32_rps": c32,
                         "hit_added_ms": {s: c1[f"hit-{s}"] - c1["kvgate"] for s in ("memory", "redis")},
                         "hit_rps_share_of_relay": {s: c32[f"hit-{s}"] / c32["relay"] for s in ("memory", "redis")}}
    finally:
        for p in procs:
            p.terminate()
            p.wait()
    return out


def reserve_settle_p50(redis: RedisServer, rounds: int) -> dict:
    """In-process, per store: p50 ms of one reservation (the admission check) and of the settle
    that ends it, on a ledger with one budget. Steadier than end to end on a loaded machine."""
    from gateway.budgets.ledger import Budgets
    from gateway.budgets.memory import MemoryStore
    from gateway.budgets.redis_store import RedisStore
    from gateway.config import BudgetsConfig, LimitsStoreConfig, RequestLimits
    from gateway.keys.store import ApiKey
    from gateway.protocol.completions import parse_completion

    cfg = BudgetsConfig.model_validate({"limits": [{"name": "t", "team": "bench", "limit": 1e15, "window": "day"}]})
    key = ApiKey("budgeted", b"", None, None, None, None, None, team="bench")
    parsed = parse_completion({"model": "echo", "prompt": PROMPT, "max_tokens": 16}, RequestLimits())
    usage = {"prompt_tokens": 36, "completion_tokens": 16}

    async def run(store) -> dict:
        ledger = Budgets(cfg, {"echo": "echo"}, store)
        reserve, settle = [], []
        for _ in range(rounds):
            t0 = time.perf_counter()
            hold = await ledger.reserve(key, "echo", parsed)
            t1 = time.perf_counter()
            ledger.settle(hold, usage, 200)
            await ledger.drain()
            reserve.append(t1 - t0)
            settle.append(time.perf_counter() - t1)
        await ledger.stop()
        return {"reserve_p50_ms": 1000 * statistics.median(reserve), "settle_p50_ms": 1000 * statistics.median(settle)}

    where = LimitsStoreConfig(kind="redis", url_env="X", key_prefix="micro", timeout_s=2)
    return {"memory": asyncio.run(run(MemoryStore())), "redis": asyncio.run(run(RedisStore(where, redis.url)))}


def admission_bench(workdir: Path, redis: RedisServer, args) -> dict:
    out = {"in_process": reserve_settle_p50(redis, args.rounds * 10)}
    env = {"BENCH_REDIS_URL": redis.url, "BENCH_KEY": KEY, "BENCH_FREE_KEY": FREE_KEY}
    for store in ("memory", "redis"):
        where = "{kind: memory}" if store == "memory" else "{kind: redis, url_env: BENCH_REDIS_URL}"
        proc, gw = gateway(workdir, f"adm-{store}", BUDGET_CONFIG.format(store=where, k=1e15, tps=0), env)
        try:
            b = body("echo", False)
            p50 = asyncio.run(turns_at_c1({"free": (gw, b, FREE_KEY), "budgeted": (gw, b, KEY)}, args.rounds))
        finally:
            proc.terminate()
            proc.wait()
        out[store] = {**p50, "added_ms": p50["budgeted"] - p50["free"]}
    return out


async def one_stream(client: httpx.AsyncClient, base: str, cut: bool) -> tuple[int, int]:
    """(status, tokens the client was shown: the usage chunk's total, or a cut stream's chunks)."""
    b = {"model": "echo", "prompt": PROMPT, "max_tokens": 32, "stream": True,
         "stream_options": {"include_usage": True}}
    async with client.stream("POST", base + "/v1/completions", json=b,
                             headers={"authorization": f"Bearer {KEY}"}) as r:
        if r.status_code != 200:
            await r.aread()
            return r.status_code, 0
        chunks = 0
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            data = json.loads(line[6:])
            if data.get("usage"):
                return 200, data["usage"]["total_tokens"]
            chunks += 1
            if cut and chunks == 3:
                return 499, chunks
    return 200, 0


def overrun_bench(workdir: Path, redis: RedisServer, args) -> dict:
    env = {"BENCH_REDIS_URL": redis.url, "BENCH_KEY": KEY, "BENCH_FREE_KEY": FREE_KEY}
    store = "{kind: redis, url_env: BENCH_REDIS_URL, key_prefix: overrun}"
    text = BUDGET_CONFIG.format(store=store, k=args.k, tps=100)
    replicas = [gateway(workdir, f"replica-{i}", text, env) for i in range(2)]
    bases = [base for _, base in replicas]
    shown, cut_chunks, waves, statuses = 0, 0, 0, {}
    try:
        async def wave():
            limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
            async with httpx.AsyncClient(timeout=120, limits=limits) as client:
                return await asyncio.gather(*(one_stream(client, bases[i % 2], cut=i % 4 == 3) for i in range(64)))
        while True:
            waves += 1
            results = asyncio.run(wave())
            for status, tokens in results:
                statuses[status] = statuses.get(status, 0) + 1
                shown += tokens if status == 200 else 0
                cut_chunks += tokens if status == 499 else 0
            if all(s == 429 for s, _ in results) or waves > 50:
                break
        time.sleep(0.5)  # the last settles
        info = httpx.get(bases[0] + "/key/info", headers={"authorization": f"Bearer {KEY}"}).json()["budgets"][0]
    finally:
        for proc, _ in replicas:
            proc.terminate()
            proc.wait()
    return {"k": args.k, "waves": waves, "statuses": statuses, "spend": info["spend"], "reserved": info["reserved"],
            "whole_streams_usage": shown, "cut_streams_chunks": cut_chunks, "overrun": info["spend"] > args.k}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=300, help="c=1 requests per target")
    ap.add_argument("--total", type=int, default=2000, help="c=32 requests per target and run")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--k", type=float, default=3000, help="the no-overrun budget, tokens")
    ap.add_argument("--only", choices=["cache", "admission", "overrun"], action="append")
    ap.add_argument("--out", default="bench/results/cache_budgets.json")
    args = ap.parse_args()
    parts = args.only or ["cache", "admission", "overrun"]
    redis = RedisServer()
    result = {"load_before": os.getloadavg()}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for part, run in (("cache", cache_bench), ("admission", admission_bench), ("overrun", overrun_bench)):
                if part in parts:
                    result[part] = run(Path(tmp), redis, args)
                    print(part, json.dumps(result[part], indent=1), flush=True)
    finally:
        redis.kill()
    result["load_after"] = os.getloadavg()
    print("load", result["load_before"], result["load_after"])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
