"""Cache hits at concurrency 32 against the bare relay, side by side, with another checkout beside.

issue 46's goal: whole-answer and streamed hits at >= 0.80x bench/bare_relay.py's requests/s. One
bench/bare_server.py upstream (16 chunks); bench/bare_relay.py in front of it; this tree's
`kvgate serve` and, with --baseline TREE, that checkout's, each with one cached model (memory
store, scope shared). Greedy /v1/completions (bench/cache_budgets.py's request and its c=32 driver,
one shared httpx client), whole then streamed; the targets take turns run by run (--repeats runs
of --total requests each), and each run also reads the server's CPU seconds (process tree, /proc):
CPU per request is the steadier figure on a shared machine. Medians and the runs themselves.

    .venv/bin/python bench/cache_hits.py [--baseline TREE] [--repeats 3] [--total 600] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from cache_budgets import body, rps_at_c32  # noqa: E402
from tests.support.servers.loopback import free_port  # noqa: E402
from upstream_overhead import checkout_env, spawn, stop_servers, tree_cpu_s  # noqa: E402

CONFIG = """
server: {{log_level: warning}}
models:
  - name: echo-mem
    cache: {{scope: shared}}
    deployments: [{{name: u1, backend: openai, settings: {{base_url: "{up}/v1", metrics: none}}}}]
"""


def start(workdir: Path, baseline: Path | None) -> tuple[dict, dict]:
    """(every server by name, the measured targets: name -> (process, base url, model))."""
    servers: dict = {}
    up_port, relay_port = free_port(), free_port()
    upstream, relay = f"http://127.0.0.1:{up_port}", f"http://127.0.0.1:{relay_port}"
    servers["upstream"] = (spawn([sys.executable, str(ROOT / "bench/bare_server.py"), str(up_port), "16"],
                                 upstream + "/health/ready"), upstream)
    servers["relay"] = (spawn([sys.executable, str(ROOT / "bench/bare_relay.py"), str(relay_port), upstream],
                              relay + "/health/ready"), relay)
    (workdir / "kvgate.yaml").write_text(CONFIG.format(up=upstream))
    for name, tree in (("kvgate", ROOT), ("baseline", baseline)):
        if tree is None:
            continue
        port = free_port()
        servers[name] = (spawn([sys.executable, "-m", "gateway.cli", "serve", "--config", str(workdir / "kvgate.yaml"),
                                "--port", str(port)], f"http://127.0.0.1:{port}/health/ready",
                               env=checkout_env(tree), cwd=tree), f"http://127.0.0.1:{port}")
    targets = {n: (p, url, "echo" if n == "relay" else "echo-mem")
               for n, (p, url) in servers.items() if n != "upstream"}
    return servers, targets


def measure(targets: dict, stream: bool, repeats: int, total: int) -> dict:
    rps: dict[str, list[float]] = {n: [] for n in targets}
    cpu: dict[str, list[float]] = {n: [] for n in targets}
    for _ in range(repeats):  # turns run by run, so drift hits every target alike
        for name, (proc, url, model) in targets.items():
            before = tree_cpu_s(proc.pid)
            rps[name].append(asyncio.run(rps_at_c32(url, body(model, stream), total)))
            cpu[name].append(1000 * (tree_cpu_s(proc.pid) - before) / (total + 32))  # + the warm-up
    out = {}
    for name in targets:
        r, c = statistics.median(rps[name]), statistics.median(cpu[name])
        out[name] = {"rps": r, "cpu_ms_per_req": c, "rps_runs": rps[name], "cpu_runs": cpu[name],
                     "rps_share_of_relay": r / statistics.median(rps["relay"]),
                     "cpu_of_relay": c / statistics.median(cpu["relay"])}
        print(f"{'stream' if stream else 'whole':6} {name:8} {r:7.1f} req/s "
              f"({out[name]['rps_share_of_relay']:.2f}x relay)"
              f"  CPU {c:.3f} ms/req ({out[name]['cpu_of_relay']:.2f}x relay)  runs {[round(x) for x in rps[name]]}"
              f" req/s, {[round(x, 3) for x in cpu[name]]} ms", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--baseline", default=None, help="another checkout's gateway beside this one's")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--total", type=int, default=600, help="requests per run")
    parser.add_argument("--out", default=str(ROOT / "bench/results/cache_hits.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        servers, targets = start(Path(tmp), Path(args.baseline).resolve() if args.baseline else None)
        try:
            results = {kind: measure(targets, kind == "stream", args.repeats, args.total)
                       for kind in ("whole", "stream")}
        finally:
            stop_servers(servers)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"baseline": args.baseline, "repeats": args.repeats, "total": args.total,
                                          **results}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
