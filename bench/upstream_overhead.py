"""What a gateway adds in front of an OpenAI-compatible upstream: kvgate (openai backend) vs LiteLLM.

One fast fixed-response upstream (bench/bare_server.py: 16 chunks, no model) is called three ways
in this one run, side by side, with the same requests:
- `direct`:  the upstream itself (the floor);
- `kvgate`:  `kvgate serve` with one `backend: openai` deployment pointing at the upstream;
- `relay`:   with --relay, bench/bare_relay.py: the same hop with no gateway logic (the hop's own cost);
- `litellm`: LiteLLM's proxy (`litellm[proxy]`, installed by this script into its own venv) with
  the upstream as an OpenAI-compatible text-completion model.
An async httpx client (or one per worker: see `drive`) drives each at concurrency 1, 32 and 128,
streaming and not, for each case (--cases): `plain` is /v1/completions, max_tokens 16; `tools` is
a chat request as agents send it (two tools with JSON-schema parameters, tool_choice auto, a
json_schema response_format, max_tokens 16) that the upstream answers with one tool call, its
arguments in 16 fragments: what the gateway's checks of tools and schemas and its carrying of
tool-call deltas cost. A target that refuses a case (an older kvgate as --baseline) is left out
of that case, saying so. Warm-up requests are excluded; each cell is the median of --repeats runs.
Each row also holds the cell under `vllm bench serve --save-result`'s keys (`vllm_bench_serve`,
bench/serve_metrics.py; TTFT/ITL from the stream's chunks; total_input_tokens is 0: the
fixed-response upstream counts no prompt tokens).
Reported: requests/s (and as a share of direct's), client-side latency p50/p99 (streams: until
[DONE]), the latency each gateway adds over `direct` (as a difference of the cells' medians, and
paired: the median of each repeat's difference, steadier when the machine's speed drifts), and the CPU time the server process (with its children) spent per
request: on a shared 2-core machine that last column is the steadiest measure of a gateway's cost
(for `direct` it is the upstream's own). All processes share the cores with the client.

    .venv/bin/python bench/upstream_overhead.py [--quick] [--no-litellm] [--stream no] [--concurrency 32,128]
        [--client-per-worker] [--baseline TREE] [--relay] [--placement free|split] [--cases plain,tools]
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
from tests.support.servers.loopback import free_port  # noqa: E402

sys.path.insert(0, str(ROOT / "bench"))
from gateway_overhead import MAX_TOKENS, PROMPT, one_request  # noqa: E402  (the same requests as that bench)
from serve_metrics import RequestSample, serve_metrics  # noqa: E402

LITELLM_VENV = Path(os.environ.get("KVGATE_LITELLM_VENV", "/tmp/kvgate-litellm-venv"))
CONCURRENCY = (1, 32, 128)
# LiteLLM refuses to start without a master key; every target gets it (the others ignore it).
BENCH_KEY = "sk-bench-" + "0123456789abcdef" * 4

KVGATE_CONFIG = """
server:
  log_level: warning
models:
  - name: echo
    aliases: [echo-chat]
    deployments:
      - name: upstream-0
        backend: openai
        settings:
          base_url: {upstream}/v1
          metrics: none
"""
LITELLM_CONFIG = """
model_list:
  - model_name: echo
    litellm_params:
      model: text-completion-openai/echo
      api_base: {upstream}/v1
      api_key: unused
  - model_name: echo-chat
    litellm_params:
      model: openai/echo
      api_base: {upstream}/v1
      api_key: unused
litellm_settings:
  drop_params: true
"""


def ensure_litellm() -> Path:
    exe = LITELLM_VENV / "bin" / "litellm"
    if not exe.exists():
        print(f"installing litellm[proxy] into {LITELLM_VENV} ...", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(LITELLM_VENV)], check=True)
        subprocess.run([str(LITELLM_VENV / "bin" / "pip"), "install", "-q", "litellm[proxy]==1.108.7"], check=True)
    return exe


CASES = ("plain", "tools")
TOOLS_BODY = {
    "model": "echo-chat", "max_tokens": MAX_TOKENS, "tool_choice": "auto",
    "messages": [{"role": "system", "content": "You are a weather assistant."}, {"role": "user", "content": PROMPT}],
    "tools": [
        {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city.",
                                          "parameters": {"type": "object", "required": ["city"], "properties": {
                                              "city": {"type": "string"}, "unit": {"enum": ["C", "F"]}}}}},
        {"type": "function", "function": {"name": "get_forecast", "description": "Forecast for the next days.",
                                          "parameters": {"type": "object", "required": ["city", "days"], "properties": {
                                              "city": {"type": "string"},
                                              "days": {"type": "integer", "minimum": 1, "maximum": 14}}}}},
    ],
    "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "strict": True, "schema": {
        "type": "object", "required": ["summary"], "additionalProperties": False,
        "properties": {"summary": {"type": "string"}, "temperature": {"type": "number"}}}}},
}


async def case_request(client: httpx.AsyncClient, stream: bool, case: str,
                       chunk_times: list[float] | None = None) -> float:
    """One request of `case`: seconds until the whole answer (streams: until [DONE]);
    `chunk_times` collects when its chunks arrived (see one_request)."""
    if case == "plain":
        return await one_request(client, stream, chunk_times=chunk_times)
    return await one_request(client, stream, "/v1/chat/completions", TOOLS_BODY, chunk_times)


def serving(servers: dict, case: str) -> dict:
    """The targets that answer one request of `case` (an older kvgate refuses tools)."""
    kept = {}
    path, body = (("/v1/chat/completions", TOOLS_BODY) if case == "tools" else
                  ("/v1/completions", {"model": "echo", "prompt": PROMPT, "max_tokens": MAX_TOKENS}))
    for name, (proc, base) in servers.items():
        try:
            with httpx.Client(base_url=base, timeout=60, headers={"authorization": f"Bearer {BENCH_KEY}"}) as c:
                status = c.post(path, json=body).status_code
        except httpx.HTTPError as exc:
            status = type(exc).__name__
        if status == 200:
            kept[name] = (proc, base)
        else:
            print(f"{name} does not serve the {case} case ({status}): left out of it", flush=True)
    return kept


def spawn(cmd: list[str], ready_url: str, env: dict | None = None, timeout: float = 120,
          cwd: Path | None = None) -> subprocess.Popen:
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                            stdout=log, stderr=subprocess.STDOUT, cwd=cwd)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"{cmd[0]} exited:\n{log.read().decode()[-3000:]}")
        try:
            if httpx.get(ready_url, timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"{cmd} did not become ready at {ready_url}")


def place(servers: dict, placement: str) -> None:
    """`split`: this client alone on CPU 0, every server (with its threads and children) on CPU 1.
    On a shared 2-vCPU machine the scheduler's free placement makes a streamed request's c=1
    latency swing by ~1 ms between runs (cross-vCPU wake-ups of three busy processes); pinned, the
    servers hand off on one core and the client never competes with them."""
    if placement == "free":
        return
    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("--placement split needs two CPUs")
    client_cpu, server_cpu = sorted(os.sched_getaffinity(0))[:2]
    _pin_threads(os.getpid(), {client_cpu})  # not its children: the servers go elsewhere
    for proc, _ in servers.values():
        _pin_tree(proc.pid, {server_cpu})


def _pin_threads(pid: int, cpus: set[int]) -> None:
    for tid in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(tid), cpus)


def _pin_tree(pid: int, cpus: set[int]) -> None:
    """Every thread of `pid` and of its descendants (Linux /proc)."""
    children = [int(c) for t in os.listdir(f"/proc/{pid}/task")
                for c in Path(f"/proc/{pid}/task/{t}/children").read_text().split()]
    _pin_threads(pid, cpus)
    for child in children:
        _pin_tree(child, cpus)


def checkout_env(root: Path) -> dict[str, str]:
    """PYTHONPATH that runs the gateway and plugins of the checkout at `root` (run it with cwd=root:
    the current directory comes first on the import path)."""
    paths = [root, *(root / "plugins" / p for p in ("echo", "openai", "native", "tensorrt_llm"))]
    return {"PYTHONPATH": os.pathsep.join(map(str, paths))}


def start_servers(workdir: Path, with_litellm: bool, baseline: Path | None = None,
                  with_relay: bool = False,
                  baseline_python: str = sys.executable) -> dict[str, tuple[subprocess.Popen, str]]:
    """Every target, started; if one fails to start, those started before it are stopped."""
    servers: dict[str, tuple[subprocess.Popen, str]] = {}
    try:
        _start_into(servers, workdir, with_litellm, baseline, with_relay, baseline_python)
    except BaseException:
        stop_servers(servers)
        raise
    return servers


def stop_servers(servers: dict) -> None:
    for proc, _ in servers.values():
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def _start_into(servers: dict, workdir: Path, with_litellm: bool, baseline: Path | None, with_relay: bool,
                baseline_python: str) -> None:
    port = free_port()
    upstream = f"http://127.0.0.1:{port}"
    servers["direct"] = (spawn([sys.executable, str(ROOT / "bench/bare_server.py"), str(port), str(MAX_TOKENS)],
                               upstream + "/health/ready"), upstream)
    kv_port = free_port()
    (workdir / "kvgate.yaml").write_text(KVGATE_CONFIG.format(upstream=upstream))
    servers["kvgate"] = (spawn([sys.executable, "-m", "gateway.cli", "serve", "--config", str(workdir / "kvgate.yaml"),
                                "--port", str(kv_port)], f"http://127.0.0.1:{kv_port}/health/ready"),
                         f"http://127.0.0.1:{kv_port}")
    if with_relay:  # the floor: the same hop with no gateway logic (bench/bare_relay.py)
        relay_port = free_port()
        servers["relay"] = (spawn([sys.executable, str(ROOT / "bench/bare_relay.py"), str(relay_port), upstream],
                                  f"http://127.0.0.1:{relay_port}/health/ready"),
                            f"http://127.0.0.1:{relay_port}")
    if baseline is not None:  # another checkout's gateway and plugins, e.g. a worktree of an older commit
        base_port = free_port()
        servers["baseline"] = (spawn([baseline_python, "-m", "gateway.cli", "serve",
                                      "--config", str(workdir / "kvgate.yaml"), "--port", str(base_port)],
                                     f"http://127.0.0.1:{base_port}/health/ready",
                                     env=checkout_env(baseline), cwd=baseline),
                               f"http://127.0.0.1:{base_port}")
    if with_litellm:
        exe = ensure_litellm()
        ll_port = free_port()
        (workdir / "litellm.yaml").write_text(LITELLM_CONFIG.format(upstream=upstream))
        env = {"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "ERROR", "LITELLM_TELEMETRY": "False",
               "LITELLM_MASTER_KEY": BENCH_KEY}
        servers["litellm"] = (spawn([str(exe), "--config", str(workdir / "litellm.yaml"), "--port", str(ll_port),
                                     "--num_workers", "1"], f"http://127.0.0.1:{ll_port}/health/readiness", env),
                              f"http://127.0.0.1:{ll_port}")


def tree_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process and its descendants (Linux /proc)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _stat(int(entry))
            if stat:
                parents[int(entry)] = int(stat[1])
    tree, frontier = {pid}, [pid]
    while frontier:
        children = [p for p, parent in parents.items() if parent in frontier and p not in tree]
        tree.update(children)
        frontier = children
    ticks = sum(int(s[11]) + int(s[12]) for s in map(_stat, tree) if s)
    return ticks / os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2:].split()  # fields after the command name: state, ppid, ...


async def drive(base: str, concurrency: int, total: int, stream: bool, pid: int, shared: bool = True,
                case: str = "plain") -> dict:
    """`concurrency` workers send `total` requests between them, on one shared httpx client (the
    default: how the issue-18 figures were taken) or, with shared=False, each on its own client
    (one keep-alive connection each). The shared client is a bottleneck of its own: httpcore's
    pool rescans every connection (a socket poll per idle one) twice per request, 35-50 % of the
    client's CPU at concurrency 128, more the burstier the answers, and it holds some requests
    for seconds (a gateway's own time per request stayed under 0.25 s while the client saw 5 s):
    the p99 stalls at c=128 are the client's. Per-worker clients do not stall, and send each
    target ~2x the requests/s, so a gateway's own cost weighs more in its share of `direct`."""
    headers = {"authorization": f"Bearer {BENCH_KEY}"}
    if shared:
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        clients = [httpx.AsyncClient(base_url=base, limits=limits, timeout=120, headers=headers)] * concurrency
    else:
        clients = [httpx.AsyncClient(base_url=base, timeout=120, headers=headers) for _ in range(concurrency)]
    try:
        warm = clients[:min(concurrency, 16)] if shared else clients  # every worker's connection is open
        await asyncio.gather(*(case_request(c, stream, case) for c in warm))  # warm-up
        latencies: list[float] = []
        errors: list[str] = []
        samples: list[RequestSample] = []
        remaining = [total]

        async def worker(client: httpx.AsyncClient):
            while remaining[0] > 0:
                remaining[0] -= 1
                sample = RequestSample(time.perf_counter(), output_tokens=MAX_TOKENS)
                samples.append(sample)
                try:
                    latencies.append(await case_request(client, stream, case, sample.chunk_times_s))
                except httpx.HTTPError as exc:  # counted and reported, not fatal to the run
                    sample.success = False
                    status = getattr(getattr(exc, "response", None), "status_code", None)
                    errors.append(f"{type(exc).__name__}{f' {status}' if status else ''}")

        cpu_before, start = tree_cpu_s(pid), time.perf_counter()
        await asyncio.gather(*(worker(c) for c in clients))
        elapsed, cpu = time.perf_counter() - start, tree_cpu_s(pid) - cpu_before
    finally:
        for client in set(clients):
            await client.aclose()
    latencies.sort()
    if not latencies:
        raise RuntimeError(f"every request to {base} failed: {sorted(set(errors))}")
    return {"rps": len(latencies) / elapsed, "errors": len(errors), "error_kinds": sorted(set(errors)),
            "p50_ms": 1000 * statistics.median(latencies),
            "p99_ms": 1000 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
            "cpu_ms_per_req": 1000 * cpu / total, "vllm_bench_serve": serve_metrics(samples, elapsed)}


def median_of(runs: list[dict]) -> dict:
    """Medians of the numbers, key by key (nested: the `vllm bench serve` keys); lists (the kinds
    of errors seen) are merged (an even number of repeats would otherwise average two lists)."""
    return {k: _median([r[k] for r in runs]) for k in runs[0]}


def _median(values: list):
    if isinstance(values[0], list):
        return sorted({v for vs in values for v in vs})
    if isinstance(values[0], dict):
        return median_of(values)
    return None if values[0] is None else statistics.median(values)


def measure(servers: dict, repeats: int, quick: bool, streams=(False, True), shared: bool = True,
            concurrencies=CONCURRENCY, cases=("plain",)) -> list[dict]:
    rows = []
    for case in cases:
        rows += measure_case(serving(servers, case), repeats, quick, streams, shared, concurrencies, case)
    return rows


def measure_case(servers: dict, repeats: int, quick: bool, streams, shared: bool, concurrencies, case: str) -> list[dict]:
    rows = []
    for stream in streams:
        for concurrency in concurrencies:
            total = {1: 60 if quick else 200, 32: 300 if quick else 800, 128: 400 if quick else 1000}[concurrency]
            runs: dict[str, list[dict]] = {name: [] for name in servers}
            for _ in range(repeats):  # interleaved, so drift hits every target alike
                for name, (proc, base) in servers.items():
                    runs[name].append(asyncio.run(drive(base, concurrency, total, stream, proc.pid, shared, case)))
            cell = {name: median_of(r) for name, r in runs.items()}
            for name, result in cell.items():
                row = {"case": case, "target": name, "stream": stream, "concurrency": concurrency, "requests": total,
                       **result,
                       "added_p50_ms": result["p50_ms"] - cell["direct"]["p50_ms"],
                       "added_p99_ms": result["p99_ms"] - cell["direct"]["p99_ms"],
                       "added_p50_paired_ms": paired_added_p50(runs[name], runs["direct"]),
                       "cpu_ms_per_req_runs": [r["cpu_ms_per_req"] for r in runs[name]],  # the spread
                       "rps_share": result["rps"] / cell["direct"]["rps"]}
                rows.append(row)
                print_row(row)
    return rows


def paired_added_p50(target_runs: list[dict], direct_runs: list[dict]) -> float:
    """The median over repeats of (target p50 - direct p50) of the same repeat: each pair ran back to
    back, so the machine's drift between repeats (its speed swings ~2x on a shared 2-core VM)
    cancels out, which a difference of medians does not."""
    return statistics.median(t["p50_ms"] - d["p50_ms"] for t, d in zip(target_runs, direct_runs))


def print_row(r: dict) -> None:
    print(f"{r['case']:>5} {r['target']:>8} stream={str(r['stream']):5} c={r['concurrency']:>3}  {r['rps']:8.1f} req/s  "
          f"p50 {r['p50_ms']:8.2f} ms  p99 {r['p99_ms']:8.2f} ms  added p50 {r['added_p50_ms']:+8.2f} ms  "
          f"p99 {r['added_p99_ms']:+8.2f} ms  paired p50 {r['added_p50_paired_ms']:+6.2f} ms  "
          f"{r['rps_share']:5.0%} of direct's req/s  cpu {r['cpu_ms_per_req']:6.2f} ms/req "
          f"{[round(c, 2) for c in r['cpu_ms_per_req_runs']]}"
          + (f"  errors {r['errors']:.0f}" if r["errors"] else ""), flush=True)


def verdict(rows: list[dict]) -> list[dict]:
    """Per cell: kvgate's added p50 as a share of LiteLLM's, and its requests/s as a multiple."""
    out = []
    cells = {(r["case"], r["stream"], r["concurrency"]): {} for r in rows}
    for r in rows:
        cells[(r["case"], r["stream"], r["concurrency"])][r["target"]] = r
    for (case, stream, concurrency), c in cells.items():
        if "litellm" not in c or "kvgate" not in c:
            continue
        kv, ll = c["kvgate"], c["litellm"]
        share = kv["added_p50_ms"] / ll["added_p50_ms"] if ll["added_p50_ms"] > 0 else float("nan")
        out.append({"case": case, "stream": stream, "concurrency": concurrency, "added_p50_share": share,
                    "rps_multiple": kv["rps"] / ll["rps"],
                    "goal_met": share < 0.25 and kv["rps"] / ll["rps"] >= 3})
        print(f"{case:>5} stream={str(stream):5} c={concurrency:>3}: kvgate adds {share:5.1%} of LiteLLM's median latency, "
              f"serves {kv['rps'] / ll['rps']:4.1f}x its requests/s -> goal {'met' if out[-1]['goal_met'] else 'MISSED'}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer requests and one repeat (a smoke run)")
    parser.add_argument("--repeats", type=int, default=None, help="runs per cell (default 3, quick 1)")
    parser.add_argument("--no-litellm", action="store_true", help="skip LiteLLM (no install)")
    parser.add_argument("--stream", choices=("both", "yes", "no"), default="both", help="which requests to send")
    parser.add_argument("--concurrency", default=",".join(map(str, CONCURRENCY)),
                        help="comma-separated, from " + ", ".join(map(str, CONCURRENCY)))
    parser.add_argument("--client-per-worker", action="store_true",
                        help="one httpx client per worker instead of one shared client (see drive)")
    parser.add_argument("--baseline", default=None,
                        help="also run this checkout's gateway (e.g. a git worktree of an older commit) as 'baseline'")
    parser.add_argument("--baseline-python", default=sys.executable,
                        help="the Python that runs --baseline: a venv whose installed entry points are that "
                             "checkout's (this venv's name the current tree's modules, which an older tree may lack)")
    parser.add_argument("--relay", action="store_true",
                        help="also run bench/bare_relay.py (the hop with no gateway logic) as 'relay'")
    parser.add_argument("--placement", choices=("free", "split"), default="free",
                        help="free: the scheduler places the processes; split: this client on one CPU, "
                             "every server on another (see place)")
    parser.add_argument("--cases", default=",".join(CASES),
                        help="comma-separated, from " + ", ".join(CASES) + " (see the module doc)")
    parser.add_argument("--out", default=str(ROOT / "bench/results/upstream_overhead.json"))
    args = parser.parse_args()
    repeats = args.repeats or (1 if args.quick else 3)
    streams = {"both": (False, True), "yes": (True,), "no": (False,)}[args.stream]
    with tempfile.TemporaryDirectory() as tmp:
        servers = start_servers(Path(tmp), with_litellm=not args.no_litellm,
                                baseline=Path(args.baseline).resolve() if args.baseline else None,
                                with_relay=args.relay, baseline_python=args.baseline_python)
        try:
            place(servers, args.placement)
            rows = measure(servers, repeats, args.quick, streams, not args.client_per_worker,
                           [int(c) for c in args.concurrency.split(",")], args.cases.split(","))
        finally:
            stop_servers(servers)
    summary = verdict(rows)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"max_tokens": MAX_TOKENS, "repeats": repeats, "quick": args.quick,
                                          "shared_client": not args.client_per_worker, "baseline": args.baseline,
                                          "relay": args.relay, "cases": args.cases.split(","),
                                          "placement": args.placement,
                                          "rows": rows, "verdict": summary}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
