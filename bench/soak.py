"""Soak: many concurrent streams against the native engine for minutes, a fifth of them cut by
their client mid-way (issue 17's soak tier).

One `kvgate serve` process (its own process, as in production) serves SmolLM2 through the native
engine. --streams workers each send streaming completions back to back (random prompts from
`pydoc_data.topics`, 8-48 new tokens, seeded sampling); with probability --cut-fraction a worker
hangs up after a random number of chunks. Every stream that is not cut is checked byte by byte:

- lost: the connection failed or ended without `[DONE]`;
- garbled: a line that is not `data: <json>`, a chunk after `[DONE]`, a chunk without choices
  or with another index, an error event, no finish_reason, or a usage chunk whose
  completion_tokens is smaller than the chunks that carried text;
- refused: an HTTP status other than 200 (load shedding would show here; none is expected with
  the queue limits below).

The gateway's RSS (VmRSS of the serve process, not the engine's) is sampled every 5 s; growth is
the last sample after the run against the first after --warmup-s. At the end, once the engine
says nothing runs or waits, its KV-cache usage must be 0: every block free.

    .venv/bin/python bench/soak.py                 # 256 streams, 10 minutes (the issue's soak)
    .venv/bin/python bench/soak.py --short         # 32 streams, 60 s, 15 s warm-up: a try-out

Figures go to bench/results/soak.json (--out). Absolute rates depend on the machine: on our
shared 2-core box the engine, the gateway and this client share the cores.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.support
from tests.support.servers.loopback import free_port  # noqa: E402

sys.path.insert(0, str(ROOT / "bench"))
from upstream_overhead import spawn  # noqa: E402  (start a server, wait until it is ready)

CONFIG = """
sla_classes:
  - {{name: standard, priority: 5, max_queue_wait_s: 3600}}
default_sla_class: standard
models:
  - name: smollm2
    queue: {{max_size: 4096}}
    saturation: {{max_waiting: 4096, max_kv_cache_usage: 1.0}}
    timeouts: {{first_token_s: 3600, idle_s: 600}}
    deployments:
      - name: native-0
        backend: native
        settings: {{max_num_seqs: {max_num_seqs}, kv_cache_bytes: {kv_cache_bytes}, num_threads: {threads}}}
"""


class Tally:
    def __init__(self):
        self.counts = collections.Counter()
        self.problems: list[str] = []  # the first few, for the report

    def bad(self, kind: str, detail: str) -> None:
        self.counts[kind] += 1
        if len(self.problems) < 20:
            self.problems.append(f"{kind}: {detail}")


def prompts() -> list[str]:
    from pydoc_data.topics import topics

    words = " ".join(topics.values()).split()
    rng = random.Random(0)
    out = []
    for _ in range(200):
        start = rng.randrange(len(words) - 200)
        out.append(" ".join(words[start:start + rng.randint(8, 120)]))
    return out


async def one_stream(client: httpx.AsyncClient, url: str, rng: random.Random, texts: list[str],
                     cut_fraction: float, tally: Tally) -> None:
    max_tokens = rng.randint(8, 48)
    cut_after = rng.randint(1, max_tokens) if rng.random() < cut_fraction else None
    body = {"model": "smollm2", "prompt": rng.choice(texts), "max_tokens": max_tokens, "temperature": 0.8,
            "seed": rng.randrange(2**31), "stream": True, "stream_options": {"include_usage": True}}
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                await r.aread()
                tally.bad("refused", f"HTTP {r.status_code} {r.text[:200]}")
                return
            await _read_stream(r, cut_after, tally)
    except (httpx.HTTPError, asyncio.TimeoutError) as exc:
        tally.bad("lost", f"{type(exc).__name__}: {exc}")


async def _read_stream(r: httpx.Response, cut_after: int | None, tally: Tally) -> None:
    texts, finish, usage, done = 0, None, None, False
    async for line in r.aiter_lines():
        if not line:
            continue
        if not line.startswith("data: ") or done:
            return tally.bad("garbled", f"unexpected line {line[:120]!r}")
        payload = line[6:]
        if payload == "[DONE]":
            done = True
            continue
        try:
            chunk = json.loads(payload)
        except ValueError:
            return tally.bad("garbled", f"not JSON: {payload[:120]!r}")
        if "error" in chunk:
            return tally.bad("garbled", f"error event: {chunk['error']}")
        usage = chunk.get("usage") or usage
        choices = chunk.get("choices")
        if choices is None or (choices and choices[0].get("index") != 0):
            return tally.bad("garbled", f"chunk {payload[:120]!r}")
        if choices:
            texts += bool(choices[0].get("text"))
            finish = choices[0].get("finish_reason") or finish
        if cut_after is not None and texts >= cut_after:
            tally.counts["cut"] += 1  # leaving the block closes the connection mid-stream
            return None
    if not done:
        return tally.bad("lost", "the stream ended without [DONE]")
    if finish is None or usage is None or usage["completion_tokens"] < texts:
        return tally.bad("garbled", f"finish={finish} usage={usage} text chunks={texts}")
    tally.counts["completed"] += 1
    tally.counts["tokens"] += usage["completion_tokens"]


async def worker(client, url, seed, texts, cut_fraction, tally, until: float) -> None:
    rng = random.Random(seed)
    while time.monotonic() < until:
        await one_stream(client, url, rng, texts, cut_fraction, tally)


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


async def sample_rss(pid: int, samples: list[tuple[float, int]], started: float, stop: asyncio.Event) -> None:
    while not stop.is_set():
        samples.append((time.monotonic() - started, rss_bytes(pid)))
        try:
            await asyncio.wait_for(stop.wait(), 5)
        except TimeoutError:
            pass


async def engine_idle(client: httpx.AsyncClient, base: str, timeout_s: float = 120) -> dict:
    """The native deployment's status once nothing runs or waits (or at the timeout)."""
    deadline = time.monotonic() + timeout_s
    while True:
        status = (await client.get(base + "/status.json")).json()
        [d] = [d for m in status["models"] for d in m["deployments"]]
        if (d["running"] == 0 and d["waiting"] == 0 and d["in_flight"] == 0) or time.monotonic() > deadline:
            return d
        await asyncio.sleep(0.5)


async def drive(base: str, pid: int, args) -> dict:
    texts = prompts()
    tally = Tally()
    limits = httpx.Limits(max_connections=args.streams + 8, max_keepalive_connections=args.streams + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600, connect=30), limits=limits) as client:
        samples: list[tuple[float, int]] = []
        stop = asyncio.Event()
        started = time.monotonic()
        sampler = asyncio.create_task(sample_rss(pid, samples, started, stop))
        until = started + args.duration_s
        url = base + "/v1/completions"
        await asyncio.gather(*(worker(client, url, i, texts, args.cut_fraction, tally, until)
                               for i in range(args.streams)))
        ran_s = time.monotonic() - started
        engine = await engine_idle(client, base)
        samples.append((time.monotonic() - started, rss_bytes(pid)))
        stop.set()
        await sampler
    after_warmup = next((rss for t, rss in samples if t >= args.warmup_s), samples[-1][1])
    final = samples[-1][1]
    return {
        "streams": args.streams, "duration_s": args.duration_s, "ran_s": round(ran_s, 1),
        "cut_fraction": args.cut_fraction, "counts": dict(tally.counts),
        "lost": tally.counts["lost"], "garbled": tally.counts["garbled"], "refused": tally.counts["refused"],
        "output_tokens_per_s": round(tally.counts["tokens"] / ran_s, 1),
        "rss_after_warmup_mib": round(after_warmup / 2**20, 1), "rss_final_mib": round(final / 2**20, 1),
        "rss_growth_pct": round(100 * (final - after_warmup) / after_warmup, 2),
        "rss_samples": [(round(t, 1), round(rss / 2**20, 1)) for t, rss in samples],
        "engine_at_end": {k: engine[k] for k in ("running", "waiting", "in_flight", "kv_cache_usage")},
        "kv_all_free": engine["kv_cache_usage"] == 0.0,
        "problems": tally.problems,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--duration-s", type=float, default=600)
    parser.add_argument("--warmup-s", type=float, default=60)
    parser.add_argument("--cut-fraction", type=float, default=0.2)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--kv-cache-bytes", type=int, default=512 * 2**20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--short", action="store_true", help="32 streams for 60 s, 15 s warm-up")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "soak.json"))
    args = parser.parse_args()
    if args.short:
        args.streams, args.duration_s, args.warmup_s = 32, 60, 15
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "soak.yaml"
        config.write_text(CONFIG.format(max_num_seqs=args.max_num_seqs, kv_cache_bytes=args.kv_cache_bytes,
                                        threads=args.threads))
        base = f"http://127.0.0.1:{port}"
        server = spawn([sys.executable, "-m", "gateway.cli", "serve", "--config", str(config), "--port", str(port)],
                       base + "/health/ready", env={"PYTHONPATH": str(ROOT)}, timeout=600)
        try:
            result = asyncio.run(drive(base, server.pid, args))
        finally:
            server.terminate()
            server.wait(60)
    print(json.dumps({k: v for k, v in result.items() if k != "rss_samples"}, indent=1))
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    ok = result["lost"] == result["garbled"] == 0 and result["kv_all_free"] and result["rss_growth_pct"] < 5
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
