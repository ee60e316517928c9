"""GuideLLM against kvgate and against a server kvgate fronts, one profile, one run, one table.

Targets, one after the other, each measured by `bash bench/guidellm.sh run` with the same profile
(GuideLLM 0.8.1, its /health check on, a concurrent profile of --streams streams for --seconds
seconds, synthetic prompts of PROMPT_TOKENS and outputs of OUTPUT_TOKENS tokens with ignore_eos,
on /v1/completions by default: llama.cpp's server honours max_tokens there, not GuideLLM's chat
limit max_completion_tokens; it has no /health and ignores ignore_eos, so its check is off and
its answers may end early at EOS: the table shows the output tokens per request):
- `kvgate-native`: `kvgate serve --config configs/default.yaml` (`make serve`: kvgate's engine);
- `llamacpp`: llama.cpp's own server on the same GGUF (bench/llamacpp_server.sh; skipped, saying
  so, when it is not built);
- `kvgate-llamacpp`: kvgate (openai backend) in front of that llama.cpp server.
Prints a Markdown table of GuideLLM's medians (TTFT, ITL, output tok/s per request; requests and
output tokens per second of the whole run) and writes them, with the request counts, to --out.
Machine load is printed too: on a shared box it moves every number.

    .venv/bin/python bench/guidellm_compare.py [--seconds 30] [--streams 4] [--no-llamacpp]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]
from tests.support.servers.loopback import free_port  # noqa: E402
from upstream_overhead import spawn  # noqa: E402  (a server up once a URL answers 200)

GUIDELLM = ROOT / "bench" / "guidellm.sh"
LLAMACPP = ROOT / "bench" / "llamacpp_server.sh"
FRONT = """
models:
  - name: smollm2
    deployments:
      - name: llamacpp-0
        backend: openai
        upstream_model: smollm2
        settings: {{base_url: "{base}/v1", metrics: none, first_byte_s: 300, max_model_len: 2048}}
"""


def warm_up(base: str, model: str) -> None:
    """One request first: the engine builds its CPU kernels on the first (when not cached)."""
    httpx.post(base + "/v1/chat/completions", timeout=600, json={
        "model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "Hello"}]}).raise_for_status()


def kvgate(config: Path, port: int) -> subprocess.Popen:
    kvgate_bin = Path(sys.executable).with_name("kvgate")
    return spawn([str(kvgate_bin), "serve", "--config", str(config), "--port", str(port)],
                 f"http://127.0.0.1:{port}/health", timeout=900)


def measure(name: str, base: str, args, workdir: Path, has_health: bool = True) -> dict:
    """GuideLLM's run against one target: the counts and medians of its JSON report."""
    out = workdir / f"{name}.json"
    print(f"[{time.strftime('%H:%M:%S')}] {name}: GuideLLM {args.seconds} s, {args.streams} streams; "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)
    backend = f"request_format={args.request_format}" + ("" if has_health else ",validate_backend=false")
    subprocess.run(["bash", str(GUIDELLM), "run", base, str(out), str(args.seconds), str(args.streams)],
                   check=True, stdout=subprocess.DEVNULL, stderr=(workdir / f"{name}.guidellm.log").open("wb"),
                   env={**os.environ, "BACKEND_ARGS": backend})
    metrics = json.loads(out.read_text())["benchmarks"][0]["metrics"]
    med = {k: metrics[k]["successful"]["median"] for k in
           ("time_to_first_token_ms", "inter_token_latency_ms", "output_tokens_per_second")}
    return {"target": name, **metrics["request_totals"], **med,
            "output_tokens_per_request": metrics["output_token_count"]["successful"]["mean"],
            "requests_per_s": metrics["requests_per_second"]["successful"]["mean"],
            "output_tokens_per_s_total": metrics["output_tokens_per_second"]["total"]["mean"]}


def table(rows: list[dict]) -> str:
    lines = ["| target | requests ok / errored / incomplete | output tokens per request (mean) | TTFT median (ms) | "
             "ITL median (ms) | output tok/s per request (median) | requests/s | output tok/s (all streams) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['target']} | {r['successful']} / {r['errored']} / {r['incomplete']} | "
                     f"{r['output_tokens_per_request']:.1f} | "
                     f"{r['time_to_first_token_ms']:.0f} | {r['inter_token_latency_ms']:.1f} | "
                     f"{r['output_tokens_per_second']:.1f} | {r['requests_per_s']:.2f} | "
                     f"{r['output_tokens_per_s_total']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=int, default=30)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--no-llamacpp", action="store_true", help="kvgate over its own engine only")
    parser.add_argument("--request-format", default="/v1/completions",
                        help="GuideLLM's request_format; completions by default: llama.cpp's server honours "
                             "max_tokens there (its chat ignores max_completion_tokens, GuideLLM's chat limit)")
    parser.add_argument("--out", default=str(ROOT / "bench/results/guidellm_compare.json"))
    args = parser.parse_args()
    built = subprocess.run(["bash", str(LLAMACPP), "python"], capture_output=True, text=True).stdout.strip()
    if not args.no_llamacpp and not built:
        print("llama.cpp's server is not built (bash bench/llamacpp_server.sh install): kvgate-native only")
    rows, procs = [], []
    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="kvgate-guidellm-") as tmp:
        workdir = Path(tmp)
        try:
            port = free_port()
            procs.append(kvgate(ROOT / "configs" / "default.yaml", port))
            warm_up(f"http://127.0.0.1:{port}", "default")
            rows.append(measure("kvgate-native", f"http://127.0.0.1:{port}", args, workdir))
            procs.pop().terminate()
            if built and not args.no_llamacpp:
                upstream = free_port()
                # By default llama-cpp-python's server ends the stream in progress when another
                # request comes (interrupt_requests): under a concurrent profile it would cut
                # answers short. Off, it serves one request at a time, the others wait.
                procs.append(spawn(["bash", str(LLAMACPP), "serve", str(upstream)],
                                   f"http://127.0.0.1:{upstream}/v1/models", timeout=300,
                                   env={"KVGATE_LLAMACPP_ARGS": "--interrupt_requests false"}))
                base = f"http://127.0.0.1:{upstream}"
                warm_up(base, "smollm2")
                # Its first requests under load are far slower than the rest: an unreported pass
                # first, so that neither of the two llama.cpp rows pays for them.
                measure("llamacpp-warm-up", base, argparse.Namespace(**{**vars(args), "seconds": 10}), workdir,
                        has_health=False)
                rows.append(measure("llamacpp", base, args, workdir, has_health=False))
                front = workdir / "front.yaml"
                front.write_text(FRONT.format(base=base))
                port = free_port()
                procs.append(kvgate(front, port))
                rows.append(measure("kvgate-llamacpp", f"http://127.0.0.1:{port}", args, workdir))
        finally:
            for proc in procs:
                proc.terminate()
                proc.wait(timeout=60)
    print(table(rows))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "profile": {"kind": "concurrent", "streams": args.streams, "seconds": args.seconds,
                    "request_format": args.request_format,
                    "prompt_tokens": int(os.environ.get("PROMPT_TOKENS", 128)),
                    "output_tokens": int(os.environ.get("OUTPUT_TOKENS", 64))},
        "guidellm": "0.8.1", "load_average": {"start": load_start, "end": os.getloadavg()[0]},
        "cpus": os.cpu_count(), "rows": rows, "table": table(rows)}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
