"""What the gateway costs: the echo backend at zero delay behind kvgate, against a bare server.

Three servers run side by side in this one run, each in its own uvicorn process on loopback:
- `bare`: a minimal Starlette app that returns a fixed OpenAI-shaped response (or a fixed SSE
  stream of the same number of chunks): the floor that HTTP, uvicorn and the client cost;
- `kvgate`: the gateway serving configs/echo.yaml, one echo deployment and none of the routing
  extras (request validation, model lookup, backend call, response building);
- `routed`: the gateway with the whole routing and admission path on: a pool of 8 echo
  deployments under `least_loaded`, API keys, and per-key request and token limits (set high
  enough never to refuse, so every request pays for the checks);
- `traced`: `kvgate` with OpenTelemetry tracing on (every request sampled, spans batched to the
  console exporter, its output discarded): what tracing costs, next to `kvgate` where it is off.
An async httpx client drives each at concurrency 1, 8, 32 and 128, streaming and not, with the
same requests (16 output tokens). Warm-up requests are excluded. Reported: requests/s, and
client-side latency p50/p99 (for streams: until [DONE]). The client shares the machine's cores
with the server, so absolute numbers are low; compare the two rows of one run.

    .venv/bin/python bench/gateway_overhead.py [--quick] [--out bench/results/gateway_overhead.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.support
from tests.support.servers.loopback import free_port, wait_ready  # noqa: E402

MAX_TOKENS = 16
PROMPT = "the quick brown fox jumps over the lazy dog " * 4


BENCH_KEY = "sk-bench-0123456789"
ROUTED_CONFIG = """
auth:
  keys:
    - {name: bench, key_env: KVGATE_BENCH_KEY, requests_per_minute: 100000000, tokens_per_minute: 1000000000}
models:
  - name: echo
    policy: least_loaded
    queue: {max_size: 1024}
    deployments:
%s
""" % "\n".join(f"      - {{name: echo-{i}, backend: echo}}" for i in range(8))


TRACED_CONFIG = (ROOT / "configs/echo.yaml").read_text() + """
telemetry:
  tracing: {exporter: console, sample_ratio: 1.0}
"""


def start_server(kind: str, workdir: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    if kind == "kvgate":
        cmd = [sys.executable, "-m", "gateway.cli", "serve", "--config", str(ROOT / "configs/echo.yaml"), "--port", str(port)]
    elif kind in ("routed", "traced"):
        config = workdir / f"{kind}.yaml"
        config.write_text(ROUTED_CONFIG if kind == "routed" else TRACED_CONFIG)
        cmd = [sys.executable, "-m", "gateway.cli", "serve", "--config", str(config), "--port", str(port)]
    else:
        cmd = [sys.executable, str(Path(__file__).with_name("bare_server.py")), str(port), str(MAX_TOKENS)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "KVGATE_BENCH_KEY": BENCH_KEY}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    base = f"http://127.0.0.1:{port}"
    wait_ready(base, proc)
    return proc, base


async def one_request(client: httpx.AsyncClient, stream: bool, path: str = "/v1/completions",
                      body: dict | None = None, chunk_times: list[float] | None = None) -> float:
    """Seconds until the whole answer (streams: until [DONE]); by default a completion of PROMPT.
    `chunk_times` collects when each stream chunk (or the whole answer) arrived, for `vllm bench
    serve`'s TTFT and ITL."""
    body = {**(body or {"model": "echo", "prompt": PROMPT, "max_tokens": MAX_TOKENS}), "stream": stream}
    start = time.perf_counter()
    if stream:
        async with client.stream("POST", path, json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    break
                if chunk_times is not None and line.startswith("data: "):
                    chunk_times.append(time.perf_counter())
    else:
        r = await client.post(path, json=body)
        r.raise_for_status()
        if chunk_times is not None:
            chunk_times.append(time.perf_counter())
    return time.perf_counter() - start


async def drive(base: str, concurrency: int, total: int, stream: bool) -> dict:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    headers = {"authorization": f"Bearer {BENCH_KEY}"}
    async with httpx.AsyncClient(base_url=base, limits=limits, timeout=60, headers=headers) as client:
        await asyncio.gather(*(one_request(client, stream) for _ in range(min(concurrency, 16))))  # warm-up
        latencies: list[float] = []
        queue = list(range(total))

        async def worker():
            while queue:
                queue.pop()
                latencies.append(await one_request(client, stream))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
    latencies.sort()
    return {
        "requests": total,
        "rps": total / elapsed,
        "p50_ms": 1000 * statistics.median(latencies),
        "p99_ms": 1000 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer requests (a smoke run)")
    parser.add_argument("--out", default=str(ROOT / "bench/results/gateway_overhead.json"))
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="kvgate-bench-"))
    servers = {kind: start_server(kind, workdir) for kind in ("bare", "kvgate", "routed", "traced")}
    rows = []
    try:
        for stream in (False, True):
            for concurrency in (1, 8, 32, 128):
                total = (100 if args.quick else 400) if concurrency == 1 else (300 if args.quick else 2000)
                for kind, (_, base) in servers.items():
                    result = asyncio.run(drive(base, concurrency, total, stream))
                    rows.append({"server": kind, "stream": stream, "concurrency": concurrency, **result})
                    print_row(rows[-1])
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(timeout=30)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"max_tokens": MAX_TOKENS, "rows": rows}, indent=2))
    print(f"wrote {args.out}")


def print_row(r: dict) -> None:
    print(f"{r['server']:>7} stream={str(r['stream']):5} c={r['concurrency']:>3}  "
          f"{r['rps']:8.1f} req/s  p50 {r['p50_ms']:7.2f} ms  p99 {r['p99_ms']:7.2f} ms", flush=True)


if __name__ == "__main__":
    main()
