"""What one request costs the gateway, counted instead of timed: Python function calls per request.

Timings drift with whatever else the machine runs; call counts do not. `kvgate serve` (one
`backend: openai` deployment in front of `bench/bare_server.py`, 16 chunks, as in
bench/upstream_overhead.py) runs under cProfile, switched on and off by signals around N
sequential requests, and the calls are reported per request, by package and (with --top) by
function. Use it to compare two trees side by side:

    .venv/bin/python bench/request_cost.py [--stream] [--requests 200] [--top 30] [--root TREE]

--root runs another checkout's gateway and plugins (e.g. a `git worktree` of the last commit).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import pstats
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.support
sys.path.insert(0, str(ROOT / "bench"))
from gateway_overhead import MAX_TOKENS, one_request  # noqa: E402
from tests.support.servers.loopback import free_port  # noqa: E402
from upstream_overhead import KVGATE_CONFIG, checkout_env, spawn  # noqa: E402

# Runs `kvgate serve` with a profiler that SIGUSR1 starts and SIGUSR2 stops and writes out.
SERVE_PROFILED = """
import cProfile, signal, sys
profile, out = cProfile.Profile(), sys.argv[1]
signal.signal(signal.SIGUSR1, lambda *_: profile.enable())
signal.signal(signal.SIGUSR2, lambda *_: (profile.disable(), profile.dump_stats(out)))
sys.argv = ["kvgate", "serve", "--config", sys.argv[2], "--port", sys.argv[3]]
from gateway.cli import main
main()
"""


async def send(base: str, count: int, stream: bool) -> None:
    async with httpx.AsyncClient(base_url=base, timeout=60) as client:
        for _ in range(count):
            await one_request(client, stream)


def measure(root: Path, requests: int, stream: bool, workdir: Path) -> pstats.Stats:
    port = free_port()
    upstream_url = f"http://127.0.0.1:{port}"
    upstream = spawn([sys.executable, str(ROOT / "bench/bare_server.py"), str(port), str(MAX_TOKENS)],
                     upstream_url + "/health/ready")
    config, profile = workdir / "kvgate.yaml", workdir / "profile.out"
    config.write_text(KVGATE_CONFIG.format(upstream=upstream_url))
    kv_port = free_port()
    env = checkout_env(root)
    gateway = spawn([sys.executable, "-c", SERVE_PROFILED, str(profile), str(config), str(kv_port)],
                    f"http://127.0.0.1:{kv_port}/health/ready", env=env, cwd=root)  # cwd: sys.path[0] under -c
    base = f"http://127.0.0.1:{kv_port}"
    try:
        asyncio.run(send(base, 20, stream))  # warm-up: connections, caches, first-use imports
        gateway.send_signal(signal.SIGUSR1)
        time.sleep(0.3)
        asyncio.run(send(base, requests, stream))
        gateway.send_signal(signal.SIGUSR2)
        deadline = time.monotonic() + 30
        while not profile.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)  # the dump is written whole before it is read
        return pstats.Stats(str(profile))
    finally:
        for proc in (gateway, upstream):
            proc.kill()
            proc.wait()


def by_package(stats: pstats.Stats, root: Path) -> collections.Counter:
    counts: collections.Counter = collections.Counter()
    for (file, _line, _name), (_cc, calls, *_rest) in stats.stats.items():
        if "site-packages/" in file:
            where = file.split("site-packages/")[1].split("/")[0]
        elif file.startswith(str(root)):
            where = "kvgate: " + str(Path(file).relative_to(root))
        elif file == "~":
            where = "builtins (C)"
        else:
            where = "stdlib: " + Path(file).name
        counts[where] += calls
    return counts


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stream", action="store_true", help="streamed requests (default: not streamed)")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--top", type=int, default=0, help="also the N most-called functions")
    parser.add_argument("--root", default=str(ROOT), help="the checkout whose gateway and plugins run")
    args = parser.parse_args()
    root = Path(args.root).resolve()
    with tempfile.TemporaryDirectory() as workdir:
        stats = measure(root, args.requests, args.stream, Path(workdir))
    n = args.requests
    kind = "streamed" if args.stream else "not streamed"
    print(f"{root} ({kind}, {MAX_TOKENS} chunks): {stats.total_calls / n:.0f} Python calls per request")
    for where, calls in by_package(stats, root).most_common(20):
        print(f"  {calls / n:8.0f}  {where}")
    if args.top:
        rows = sorted(stats.stats.items(), key=lambda item: -item[1][1])[:args.top]
        for (file, line, name), (_cc, calls, *_rest) in rows:
            print(f"  {calls / n:8.1f}  {name}  {Path(file).name}:{line}")


if __name__ == "__main__":
    main()
