"""Prefill/decode disaggregation against colocated engines on the same cores: the ITL of running
decode streams while long prompts arrive, their TTFT, output tok/s and goodput, one run.

Setups (SmolLM2-135M-Instruct, GGUF Q4_1, native engines of one torch thread each, on loopback):
- colocated: two engines, routed least_loaded; a long prompt's prefill runs on one of them, in
  the steps of the streams it decodes;
- disaggregated: configs/disaggregated.yaml, one prefill engine (kv_role producer) and one decode
  engine (consumer); a long prompt is computed on the prefill engine, its KV blocks read by the
  decode engine over TCP; the streams' short prompts skip the prefill hop (min_prompt_chars 2000);
- disaggregated-all: the same engines with min_prompt_chars 0: every prompt, the streams' too, is
  computed on the prefill engine, so the decode engine runs decode steps only (and the last
  prompt tokens short of a block). The streams' own prefills are what sets the colocated and the
  `disaggregated` ITL p99 (a 60-token prefill in one decode step in ~3 % of the gaps), not the
  long prompts (their chunks stall ~0.2 % of the gaps: see ITL p99.9 and max).
Each round serves each setup in turn (a `kvgate serve` of its own, the other one stopped), with
the same requests (fixed seed), `--rounds` times; the table gives the median over rounds.

Workload of a phase (`--seconds` long): `--streams` decode streams kept running (a short chat
question, `--stream-tokens` new tokens with ignore_eos; each one that ends is followed by the
next), and long prompts (`--long-min`..`--long-max` tokens of pydoc text, a different passage
each, so no prefix cache hits) arriving one every `--interval` seconds for `--seconds`,
`--long-tokens` new tokens each; the streams go on until the last long prompt is answered.
Greedy, streamed, over HTTP to the gateway. A warm-up (a 500-token prompt and a round of
streams) precedes every phase and is not counted.

Reported per setup, vLLM's definitions (bench/serve_metrics.py): ITL p50/p99 of the streams (the
gaps between their output chunks), TTFT p50/p99 of the long prompts and of the streams, output
tok/s (output tokens of every request of the phase / the phase's wall time), and goodput: the
requests per second that met the SLO (TTFT <= `--slo-ttft-ms`, TPOT <= `--slo-tpot-ms`; TPOT is
a request's mean inter-token time) and, per gap, goodput with no gap over `--slo-itl-ms`
(`goodput_itl_req_s`: the issue's "ITL <= 150 ms" read as every gap, a stall a reader sees).
The disaggregated setup's prefill hops and colocated
fallbacks are read from the gateway's /metrics (kvgate_pd_*).

    .venv/bin/python bench/disagg.py --rounds 1           # about 25 minutes a round on 2 busy cores
    .venv/bin/python bench/disagg.py --streams 2          # fewer streams on the decode engine
    .venv/bin/python bench/disagg.py --quick              # a smoke run: short prompts, one round
    .venv/bin/python bench/disagg.py --setups colocated,disaggregated-all --rounds 1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]
from tests.support.servers.loopback import free_port  # noqa: E402
from prefix_routing import passages  # noqa: E402
from serve_metrics import RequestSample, percentile, serve_metrics  # noqa: E402
from upstream_overhead import spawn  # noqa: E402

CONFIG = ROOT / "configs" / "disaggregated.yaml"
MODEL = "smollm2-135m-instruct"
SETUPS = ("colocated", "disaggregated", "disaggregated-all")
TOKENS_PER_WORD = 1.5  # SmolLM2's tokenizer on pydoc text (4.4 characters a token)
TPOT_SLOS_MS = (100, 150, 250, 400)  # goodput is also given under these TPOT SLOs (where the crossover lies)
MAX_ITL_SLOS_MS = (150, 250, 500, 1000)  # ... and under "no gap longer than this" SLOs (a stall a reader sees)
DEFAULTS = {"--streams": 4, "--stream-tokens": 128, "--long-min": 2000, "--long-max": 4000, "--long-tokens": 16,
            "--interval": 60.0, "--seconds": 180.0, "--rounds": 2, "--slo-ttft-ms": 10000.0, "--slo-tpot-ms": 150.0,
            "--slo-itl-ms": 150.0,
            "--kv-cache-bytes": 536870912}


# ------------------------------------------------------------------------------ configs

def engine_settings(args) -> dict:
    """The engines' settings from configs/disaggregated.yaml, without its KV connector keys."""
    deployments = yaml.safe_load(CONFIG.read_text())["models"][0]["deployments"]
    settings = {k: v for k, v in deployments[0]["settings"].items() if not _connector_key(k)}
    settings.update(num_threads=1, kv_cache_bytes=args.kv_cache_bytes)
    return settings


def _connector_key(name: str) -> bool:
    return name == "kv_role" or name.startswith("kv_transfer")


def setup_config(setup: str, args) -> dict:
    """The gateway config of one setup: two native engines of one thread each."""
    config = yaml.safe_load(CONFIG.read_text())
    model = config["models"][0]
    base = engine_settings(args)
    if setup == "colocated":
        model.pop("disaggregation", None)
        model["deployments"] = [{"name": f"native-{i}", "backend": "native", "settings": dict(base)} for i in range(2)]
    else:
        for d in model["deployments"]:
            connector = {k: v for k, v in d["settings"].items() if _connector_key(k)}
            d["settings"] = {**base, **connector}
        if setup == "disaggregated-all":
            model["disaggregation"] = {"min_prompt_chars": 0}
    model["policy"] = "least_loaded"
    model["timeouts"] = {"first_token_s": 600, "idle_s": 600}
    model["queue"] = {"max_size": 256}
    return config


# ------------------------------------------------------------------------------ workload

def long_prompts(seed: int, args) -> list[str]:
    """The phase's long prompts: a passage of pydoc text each, `--long-min`..`--long-max` tokens."""
    rng = random.Random(seed)
    count = int(args.seconds // args.interval) + 1
    out = []
    for i, tokens in enumerate(rng.randint(args.long_min, args.long_max) for _ in range(count)):
        [text] = passages(seed * 1000 + i, 1, int(tokens / TOKENS_PER_WORD))
        out.append(f"Summarize this text in one sentence.\n\n{text}")
    return out


def stream_questions(seed: int, count: int) -> list[str]:
    return [f"Tell me a long story about this: {q}" for q in passages(seed, count, 20)]


async def one_request(client: httpx.AsyncClient, base: str, prompt: str, max_tokens: int) -> RequestSample:
    """A streamed chat request, as the client sees it (chunk arrival times, usage)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    sample = RequestSample(time.perf_counter())
    try:
        async with client.stream("POST", base + "/v1/chat/completions", json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    sample.output_tokens = chunk["usage"]["completion_tokens"]
                    sample.prompt_tokens = chunk["usage"]["prompt_tokens"]
                if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                    sample.chunk_times_s.append(time.perf_counter())
    except httpx.HTTPError as exc:
        print(f"    request failed: {exc!r}", flush=True)
        sample.success = False
    sample.success = sample.success and bool(sample.chunk_times_s)
    return sample


async def run_phase(base: str, seed: int, args) -> tuple[list[RequestSample], list[RequestSample], float]:
    """(stream samples, long-prompt samples, wall seconds) of one phase."""
    prompts = long_prompts(seed, args)
    questions = iter(stream_questions(seed, 10_000))
    streams: list[RequestSample] = []
    longs: list[RequestSample] = []
    started = time.perf_counter()
    end = started + args.seconds

    async with httpx.AsyncClient(timeout=httpx.Timeout(900, connect=30)) as client:
        longs_done = asyncio.Event()

        async def keep_streaming() -> None:  # until the last long prompt is answered
            while time.perf_counter() < end or not longs_done.is_set():
                streams.append(await one_request(client, base, next(questions), args.stream_tokens))

        async def arrive() -> None:
            pending = []
            for i, prompt in enumerate(prompts):
                delay = started + i * args.interval - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                if time.perf_counter() >= end:
                    break
                pending.append(asyncio.create_task(one_request(client, base, prompt, args.long_tokens)))
            longs.extend(await asyncio.gather(*pending))
            longs_done.set()

        await asyncio.gather(arrive(), *(keep_streaming() for _ in range(args.streams)))
    return streams, longs, time.perf_counter() - started


async def warm_up(base: str, args) -> None:
    """A 500-token prompt (over min_prompt_chars: the prefill hop when disaggregated) and a round
    of streams."""
    [text] = passages(99, 1, int(500 / TOKENS_PER_WORD))
    async with httpx.AsyncClient(timeout=900) as client:
        await asyncio.gather(one_request(client, base, text, 2),
                             *(one_request(client, base, q, 8) for q in stream_questions(98, args.streams)))


# ------------------------------------------------------------------------------ one setup, one round

COUNTERS = re.compile(r"^kvgate_(pd_hops|pd_colocated|engine_kv_transfer\w*)_total\{([^}]*)\} (\S+)$", re.M)


def pd_counters(base: str) -> dict[str, float]:
    """The gateway's P/D counters from /metrics: hops by pool and outcome, colocated fallbacks by
    reason, the engines' KV transfers (done, failed, tokens) summed over deployments."""
    text = httpx.get(base + "/metrics", timeout=30).text
    out: dict[str, float] = {}
    for name, labels, value in COUNTERS.findall(text):
        keys = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        tag = ":".join(keys[k] for k in ("pool", "outcome", "reason") if k in keys)
        series = f"{name}[{tag}]" if tag else name
        out[series] = out.get(series, 0.0) + float(value)
    return out


def row_of(setup: str, streams: list[RequestSample], longs: list[RequestSample], seconds: float, args) -> dict:
    done_streams = [s for s in streams if s.success]
    done_longs = [s for s in longs if s.success]
    itl = [gap for s in done_streams for gap in s.itl]
    slo = {"ttft": args.slo_ttft_ms, "tpot": args.slo_tpot_ms}
    everything = serve_metrics(streams + longs, seconds, goodput_ms=slo)
    ms = lambda values, p: 1000 * percentile(values, p)  # noqa: E731
    return {
        "setup": setup, "seconds": seconds, "streams_done": len(done_streams), "long_done": len(done_longs),
        "failed": everything["failed"],
        "long_prompt_tokens": [min((s.prompt_tokens for s in done_longs), default=0),
                               max((s.prompt_tokens for s in done_longs), default=0)],
        "itl_p50_ms": ms(itl, 50), "itl_p99_ms": ms(itl, 99), "itl_p999_ms": ms(itl, 99.9),
        "itl_max_ms": 1000 * max(itl, default=0.0),
        "long_ttft_p50_ms": ms([s.ttft for s in done_longs], 50),
        "long_ttft_p99_ms": ms([s.ttft for s in done_longs], 99),
        "stream_ttft_p50_ms": ms([s.ttft for s in done_streams], 50),
        "stream_ttft_p99_ms": ms([s.ttft for s in done_streams], 99),
        "output_tok_s": everything["output_throughput"],
        "goodput_req_s": everything["request_goodput"],
        "good_fraction": everything["request_goodput"] * seconds / max(len(streams) + len(longs), 1),
        "goodput_itl_req_s": stall_free_goodput(streams + longs, seconds, args.slo_ttft_ms, args.slo_itl_ms),
        "goodput_by_tpot_slo": {f"{tpot:g}": serve_metrics(streams + longs, seconds, goodput_ms={
            "ttft": args.slo_ttft_ms, "tpot": tpot})["request_goodput"] for tpot in TPOT_SLOS_MS},
        "goodput_by_max_itl_slo": {f"{gap:g}": stall_free_goodput(streams + longs, seconds, args.slo_ttft_ms, gap)
                                   for gap in MAX_ITL_SLOS_MS},
        "load_avg": os.getloadavg()[0],
        "vllm_keys": everything,
        "requests": [{"kind": kind, "ttft_s": s.ttft, "tpot_s": s.tpot, "max_itl_s": max(s.itl, default=0.0),
                      "prompt_tokens": s.prompt_tokens, "output_tokens": s.output_tokens}
                     for kind, group in (("stream", done_streams), ("long", done_longs)) for s in group],
    }


def stall_free_goodput(samples: list[RequestSample], seconds: float, ttft_ms: float, max_itl_ms: float) -> float:
    """Requests per second that succeeded with TTFT <= ttft_ms and no gap between two of their
    chunks over max_itl_ms: a stream that stalls once for longer is not good, however fast its
    mean (TPOT) is. The issue's "ITL <= 150 ms" read per gap rather than per request mean."""
    good = [s for s in samples if s.success and s.chunk_times_s and 1000 * s.ttft <= ttft_ms
            and 1000 * max(s.itl, default=0.0) <= max_itl_ms]
    return len(good) / seconds


def measure(setup: str, round_no: int, tmp: Path, args) -> dict:
    path, port = tmp / f"{setup}.yaml", free_port()
    path.write_text(yaml.safe_dump(setup_config(setup, args), sort_keys=False))
    base = f"http://127.0.0.1:{port}"
    kvgate = Path(sys.executable).with_name("kvgate")
    proc = spawn([str(kvgate), "serve", "--config", str(path), "--port", str(port)], base + "/health/ready",
                 timeout=900)
    try:
        asyncio.run(warm_up(base, args))
        before = pd_counters(base)
        streams, longs, seconds = asyncio.run(run_phase(base, 1 + round_no, args))
        after = pd_counters(base)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
    row = row_of(setup, streams, longs, seconds, args)
    row["round"] = round_no
    row["pd"] = {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}
    print(f"  round {round_no} {setup:<17} ITL p50 {row['itl_p50_ms']:7.1f} p99 {row['itl_p99_ms']:7.1f} "
          f"p99.9 {row['itl_p999_ms']:7.1f} max {row['itl_max_ms']:7.1f} ms | "
          f"long TTFT p50 {row['long_ttft_p50_ms'] / 1000:6.2f} p99 {row['long_ttft_p99_ms'] / 1000:6.2f} s | "
          f"{row['output_tok_s']:6.1f} out tok/s | goodput {row['goodput_req_s']:.3f} req/s "
          f"({row['good_fraction']:.0%}), with no gap > {args.slo_itl_ms:g} ms {row['goodput_itl_req_s']:.3f} | "
          f"{row['streams_done']} streams, {row['long_done']} long, "
          f"{row['failed']} failed | load {row['load_avg']:.1f} | {row['pd']}", flush=True)
    return row


# ------------------------------------------------------------------------------ the table

COLUMNS = ("itl_p50_ms", "itl_p99_ms", "itl_p999_ms", "itl_max_ms", "long_ttft_p50_ms", "long_ttft_p99_ms",
           "stream_ttft_p50_ms", "stream_ttft_p99_ms", "output_tok_s", "goodput_req_s", "good_fraction",
           "goodput_itl_req_s")


def medians(rows: list[dict]) -> dict[str, dict[str, float]]:
    setups = dict.fromkeys(r["setup"] for r in rows)  # in the order they ran
    return {setup: {c: statistics.median(r[c] for r in rows if r["setup"] == setup) for c in COLUMNS}
            for setup in setups}


def print_table(table: dict[str, dict[str, float]]) -> None:
    print(f"{'':<18}{'ITL p50':>9}{'p99':>8}{'p99.9':>8}{'max':>8}{'long TTFT p50':>15}{'p99':>8}"
          f"{'stream TTFT p50':>17}{'p99':>8}{'out tok/s':>11}{'goodput':>9}{'good':>6}")
    for setup, m in table.items():
        itl = "".join(f"{m[c]:>6.0f}ms" for c in ("itl_p99_ms", "itl_p999_ms", "itl_max_ms"))
        print(f"{setup:<18}{m['itl_p50_ms']:>7.0f}ms{itl}{m['long_ttft_p50_ms'] / 1000:>14.1f}s"
              f"{m['long_ttft_p99_ms'] / 1000:>7.1f}s{m['stream_ttft_p50_ms'] / 1000:>16.2f}s"
              f"{m['stream_ttft_p99_ms'] / 1000:>7.2f}s{m['output_tok_s']:>11.1f}{m['goodput_req_s']:>9.3f}"
              f"{m['good_fraction']:>6.0%}{m['goodput_itl_req_s']:>10.3f}")


def summarize(table: dict[str, dict[str, float]]) -> dict:
    """Each disaggregated setup against colocated: {setup: {ratio name: ratio}}."""
    co = table.get("colocated")
    ratio = lambda a, b: a / b if b else None  # noqa: E731
    return {setup: {f"{c.removesuffix('_ms')}_ratio": ratio(dis[c], co[c]) for c in RATIOS}
            for setup, dis in table.items() if setup != "colocated" and co is not None}


RATIOS = ("itl_p99_ms", "itl_p999_ms", "itl_max_ms", "itl_p50_ms", "goodput_req_s", "goodput_itl_req_s",
          "long_ttft_p50_ms", "stream_ttft_p50_ms", "output_tok_s")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for flag, default in DEFAULTS.items():
        parser.add_argument(flag, type=type(default), default=default)
    parser.add_argument("--quick", action="store_true", help="smoke run: 500-800 token prompts, 20 s, one round")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "disagg.json")
    parser.add_argument("--setups", default=",".join(SETUPS), help=f"comma-separated, of {', '.join(SETUPS)}")
    args = parser.parse_args(argv)
    setups = args.setups.split(",")
    if not setups or any(setup not in SETUPS for setup in setups):
        parser.error(f"--setups takes {', '.join(SETUPS)}, not {args.setups!r}")
    if args.quick:
        args.long_min, args.long_max, args.seconds, args.interval, args.rounds = 500, 800, 20.0, 10.0, 1
        args.stream_tokens, args.streams = min(args.stream_tokens, 32), min(args.streams, 2)
    print(f"{args.streams} streams of {args.stream_tokens} tokens; a {args.long_min}-{args.long_max} token prompt "
          f"every {args.interval:g} s ({args.long_tokens} tokens); {args.seconds:g} s phases, {args.rounds} rounds; "
          f"SLO TTFT <= {args.slo_ttft_ms:g} ms, TPOT <= {args.slo_tpot_ms:g} ms", flush=True)
    with tempfile.TemporaryDirectory(prefix="kvgate-disagg-") as tmp:
        rows = [measure(setup, r, Path(tmp), args) for r in range(args.rounds) for setup in setups]
    table = medians(rows)
    summary = summarize(table)
    print_table(table)
    for setup, ratios in summary.items():
        x = {name: value if value is not None else float("nan") for name, value in ratios.items()}
        print(f"{setup} / colocated: ITL p99 {x['itl_p99_ratio']:.2f}x (goal <= 0.5), "
              f"p99.9 {x['itl_p999_ratio']:.2f}x, "
              f"max {x['itl_max_ratio']:.2f}x, goodput {x['goodput_req_s_ratio']:.2f}x (goal >= 1; with no gap over "
              f"the ITL SLO {x['goodput_itl_req_s_ratio']:.2f}x), "
              f"long-prompt TTFT p50 {x['long_ttft_p50_ratio']:.2f}x, "
              f"stream TTFT p50 {x['stream_ttft_p50_ratio']:.2f}x")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = {"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows, "medians": table,
              "summary": summary}
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
