"""Engine throughput: kvgate's native engine against transformers `generate`, same requests, one run.

Model: SmolLM2-135M-Instruct (the default Q4_1 GGUF, dequantized to fp32), CPU, `--threads` torch
threads (default 2). Workload (fixed seed): `--requests` requests (default 64) whose prompts are
token ids of real English text (the `pydoc_data.topics` strings, concatenated and tokenized with our
tokenizer, no special tokens), cut at different, non-overlapping offsets to lengths uniform in
[64, 512]; output lengths uniform in [64, 256]. Greedy, EOS ignored, so every request produces
exactly its output length on every system.

Systems, each measurement in its own subprocess (so peak RSS and warm caches don't mix; a child
writes its result as JSON, this script collects them):
- `kvgate`: the in-process `LLMEngine` (engine defaults unless --max-num-seqs / --max-num-batched-tokens
  / --kv-cache-mib), all requests added at t=0, `step()` until done.
- `hf_static16`: transformers `generate` on padded static batches of `--hf-batch-size` (16) requests
  in submission order: left padding + attention_mask, max_new_tokens = the batch's longest output,
  EOS disabled (eos_token_id=None: no early stop, nothing suppressed, like ignore_eos). Only each
  request's own output length counts as useful tokens; the padding tail a batch computes beyond it
  does not (`hf_static16_computed_tok_s` reports everything generated).
- `hf_sequential`: `generate` one request at a time with its own max_new_tokens (slow: skip it with
  --skip-sequential).
- batch-1 decode: one 128-token prompt, 128 new tokens, on both systems (`--b1-repeats` different
  prompts, median). Decode-only rate = (new tokens - 1) / (time of last token - time of first token),
  i.e. prefill and the first token excluded; the total rate (new tokens / whole request) is reported too.

The kvgate run is also reported under `vllm bench serve --save-result`'s keys
(`kvgate_vllm_bench_serve`, bench/serve_metrics.py: every request sent at t=0, its chunks at the
steps that produced its tokens), so it can be put beside a `vllm bench serve` run.

"tok/s" is OUTPUT tokens per second of wall time (prompt tokens not counted) unless it says
`total` (prompt + output). Warm-up requests (small, different text) run first in every child and
are not timed. With --repeats R each throughput child runs R times (fresh process each: no warm
prefix cache) and the median is reported.

Correctness cross-check (never fails the bench): kvgate's greedy tokens from the throughput run
against transformers' unbatched greedy tokens: all requests when hf_sequential ran, else the
`--check` cheapest requests run one at a time by transformers. Also reported: kvgate vs the padded
static batches, and the batch-1 runs. For a divergent sequence: how many tokens match before it.

    .venv/bin/python bench/engine_throughput.py --quick            # smoke run, a few minutes
    .venv/bin/python bench/engine_throughput.py                    # the full run (tens of minutes)
    .venv/bin/python bench/engine_throughput.py --skip-sequential --repeats 3
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from engine_runs import b1_numbers, build_workload, compare, kvgate_run, kvgate_warmup, make_engine  # noqa: E402
from serve_metrics import RequestSample, serve_metrics  # noqa: E402

# From /work/shared/ANCHORS.md (2-core box): output tok/s.
ANCHORS = {
    "hf_batch1_fp32": 16.0,
    "llama_cpp_q4_1_batch1": 125.0,
    "hf_static16_mixed64": 50.0,
    "llama_cpp_sequential_mixed64": 69.0,
}



# ---------------------------------------------------------------------------------------- helpers


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def hwm_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


LOAD_PEAK_MIB: float | None = None  # the child's peak RSS up to the reset (loading, warm-up)


def reset_peak_rss() -> bool:
    """Reset the process's peak RSS (VmHWM) so the measurement phase gets its own peak (Linux >= 4.0).

    The kernel's ru_maxrss follows the reset too, so the peak so far is kept first."""
    global LOAD_PEAK_MIB
    LOAD_PEAK_MIB = max(maxrss_mib(), hwm_mib())
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def maxrss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def git_info() -> dict:
    def git(*args):
        try:
            return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.SubprocessError):
            return None

    status = git("status", "--porcelain") or ""
    diff = git("diff", "HEAD") or ""
    return {
        "commit": (git("rev-parse", "HEAD") or "").strip() or None,
        "dirty_paths": [line[3:] for line in status.splitlines() if line.strip()],
        "diff_sha256": hashlib.sha256(diff.encode()).hexdigest()[:16] if diff else None,
    }




# ---------------------------------------------------------------------------------------- children


def child_main(name: str, spec_path: str, result_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    import torch

    torch.set_num_threads(spec["threads"])
    fn = {"kvgate": kvgate_throughput, "kvgate_batch1": kvgate_batch1, "hf_static": hf_static,
          "hf_sequential": hf_sequential, "hf_batch1": hf_batch1}[name]
    result = fn(spec)
    # The whole child, loading included (the measurement phase alone: measure_peak_rss_mib).
    result["load_peak_rss_mib"] = LOAD_PEAK_MIB
    result["peak_rss_mib"] = max(maxrss_mib(), LOAD_PEAK_MIB or 0.0)
    result["torch_threads"] = torch.get_num_threads()
    Path(result_path).write_text(json.dumps(result))


def kvgate_throughput(spec) -> dict:
    engine, load_s = make_engine(spec)
    kvgate_warmup(engine, spec)
    stats_before = dataclasses.asdict(engine.stats())
    rss_loaded = rss_mib()
    reset_ok = reset_peak_rss()
    w = spec["workload"]
    run = kvgate_run(engine, w["prompts"], w["output_lens"], "r")
    stats = dataclasses.asdict(engine.stats())
    tokens = [run["tokens"][rid] for rid in run["ids"]]
    out_tokens = sum(len(t) for t in tokens)
    ttft = [run["times"][rid][0] - run["start"] for rid in run["ids"] if run["times"][rid]]
    return {
        "load_s": load_s,
        "wall_s": run["wall"],
        "out_tokens": out_tokens,
        "out_tok_s": out_tokens / run["wall"],
        "total_tok_s": (out_tokens + sum(map(len, w["prompts"]))) / run["wall"],
        "lengths_ok": [len(t) for t in tokens] == w["output_lens"],
        "finish_reasons": sorted(set(run["finish"].values())),
        "ttft_median_s": statistics.median(ttft) if ttft else None,
        "ttft_max_s": max(ttft) if ttft else None,
        "steps": run["steps"],
        "engine_stats": {k: stats[k] - stats_before.get(k, 0) if k.startswith(("num_steps", "num_step_tokens",
                                                                               "prefix_cache", "num_preempt"))
                         else stats[k] for k in stats},
        "engine": engine.describe(),
        "vllm_bench_serve": _vllm_keys(run, w["prompts"]),
        "rss_after_load_mib": rss_loaded,
        "measure_peak_rss_mib": hwm_mib() if reset_ok else None,
        "tokens": tokens,
    }


def _vllm_keys(run: dict, prompts: list[list[int]]) -> dict:
    """The run under `vllm bench serve`'s keys: every request sent at the run's start, its output
    chunks at the steps that produced tokens for it."""
    samples = [RequestSample(run["start"], sorted(set(run["times"][rid])), output_tokens=len(run["tokens"][rid]),
                             prompt_tokens=len(prompt)) for rid, prompt in zip(run["ids"], prompts)]
    return serve_metrics(samples, run["wall"])


def _b1_summary(per_prompt: list[dict]) -> dict:
    return {
        "decode_tok_s": statistics.median(p["decode_tok_s"] for p in per_prompt),
        "total_tok_s": statistics.median(p["total_tok_s"] for p in per_prompt),
        "ttft_s": statistics.median(p["ttft_s"] for p in per_prompt),
        "runs": per_prompt,
    }


def kvgate_batch1(spec) -> dict:
    engine, load_s = make_engine(spec)
    kvgate_warmup(engine, spec)
    rss_loaded = rss_mib()
    reset_ok = reset_peak_rss()
    runs, tokens = [], []
    for r, prompt in enumerate(spec["workload"]["b1_prompts"]):
        run = kvgate_run(engine, [prompt], [spec["b1_new"]], f"b1-{r}-")
        rid = run["ids"][0]
        runs.append(b1_numbers(run["start"], run["times"][rid]))
        tokens.append(run["tokens"][rid])
    return {**_b1_summary(runs), "load_s": load_s, "tokens": tokens, "rss_after_load_mib": rss_loaded,
            "measure_peak_rss_mib": hwm_mib() if reset_ok else None}


def _hf_model(spec):
    """transformers' own GGUF load (slow); the first child caches the fp32 weights for the others."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    started = time.perf_counter()
    cache = Path(spec["hf_cache_dir"])
    if (cache / "weights.pt").exists():
        config = AutoConfig.from_pretrained(cache)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(torch.load(cache / "weights.pt", weights_only=True), strict=True)
        model.generation_config = GenerationConfig.from_pretrained(cache)
        source = "cached state dict (from transformers' GGUF load)"
    else:
        p = spec["model"]
        model = AutoModelForCausalLM.from_pretrained(os.path.dirname(p), gguf_file=os.path.basename(p),
                                                     dtype=torch.float32)
        cache.mkdir(parents=True, exist_ok=True)
        model.config.to_json_file(cache / "config.json")
        model.generation_config.to_json_file(cache / "generation_config.json")
        torch.save(model.state_dict(), cache / "weights.pt.tmp")
        os.replace(cache / "weights.pt.tmp", cache / "weights.pt")
        source = "GGUF via transformers"
    if spec.get("hf_dtype", "float32") == "bfloat16":  # what a user with bf16 matrix units would run
        model.to(torch.bfloat16)
        source += ", cast to bfloat16"
    model.eval()
    return model, time.perf_counter() - started, source


def _gen_kwargs(model, max_new: int) -> dict:
    # eos_token_id=None: no stopping on EOS and no suppression of it (our engine's ignore_eos).
    return dict(max_new_tokens=max_new, do_sample=False, eos_token_id=None,
                pad_token_id=model.generation_config.pad_token_id if model.generation_config.pad_token_id is not None
                else 0)


def _hf_generate_one(model, prompt: list[int], max_new: int, streamer=None) -> list[int]:
    import torch

    ids = torch.tensor([prompt], dtype=torch.long)
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), streamer=streamer,
                             **_gen_kwargs(model, max_new))
    return out[0, ids.shape[1]:].tolist()


def _hf_generate_padded(model, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    import torch

    width = max(map(len, prompts))
    pad = _gen_kwargs(model, max_new)["pad_token_id"]
    ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompts], dtype=torch.long)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], dtype=torch.long)
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, **_gen_kwargs(model, max_new))
    return out[:, width:].tolist()


def _hf_warmup(model, spec, batched: bool) -> None:
    warm = spec["workload"]["warmup_prompts"]
    if batched:
        _hf_generate_padded(model, warm, 8)
    else:
        for p in warm:
            _hf_generate_one(model, p, 8)


def hf_static(spec) -> dict:
    model, load_s, source = _hf_model(spec)
    _hf_warmup(model, spec, batched=True)
    rss_loaded = rss_mib()
    reset_ok = reset_peak_rss()
    w, bs = spec["workload"], spec["hf_batch_size"]
    tokens, computed, lengths_ok = [], 0, True
    start = time.perf_counter()
    for b in range(0, len(w["prompts"]), bs):
        prompts, outs = w["prompts"][b:b + bs], w["output_lens"][b:b + bs]
        generated = _hf_generate_padded(model, prompts, max(outs))
        computed += sum(len(g) for g in generated)
        lengths_ok &= all(len(g) == max(outs) for g in generated)
        tokens.extend(g[:n] for g, n in zip(generated, outs))  # useful: each request's own length
    wall = time.perf_counter() - start
    useful = sum(len(t) for t in tokens)
    return {
        "load_s": load_s, "load_source": source, "wall_s": wall, "out_tokens": useful, "out_tok_s": useful / wall,
        "computed_tokens": computed, "computed_tok_s": computed / wall,
        "total_tok_s": (useful + sum(map(len, w["prompts"]))) / wall,
        "lengths_ok": lengths_ok and [len(t) for t in tokens] == w["output_lens"],
        "rss_after_load_mib": rss_loaded, "measure_peak_rss_mib": hwm_mib() if reset_ok else None,
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
        "tokens": tokens,
    }


def hf_sequential(spec) -> dict:
    model, load_s, source = _hf_model(spec)
    _hf_warmup(model, spec, batched=False)
    rss_loaded = rss_mib()
    reset_ok = reset_peak_rss()
    w = spec["workload"]
    start = time.perf_counter()
    tokens = [_hf_generate_one(model, p, n) for p, n in zip(w["prompts"], w["output_lens"])]
    wall = time.perf_counter() - start
    out_tokens = sum(len(t) for t in tokens)
    return {
        "load_s": load_s, "load_source": source, "wall_s": wall, "out_tokens": out_tokens,
        "out_tok_s": out_tokens / wall, "total_tok_s": (out_tokens + sum(map(len, w["prompts"]))) / wall,
        "lengths_ok": [len(t) for t in tokens] == w["output_lens"],
        "rss_after_load_mib": rss_loaded, "measure_peak_rss_mib": hwm_mib() if reset_ok else None,
        "tokens": tokens,
    }


def hf_batch1(spec) -> dict:
    """Batch-1 decode rate (token arrival times from a streamer), then the correctness subset."""
    from transformers.generation.streamers import BaseStreamer

    class Clock(BaseStreamer):
        def __init__(self):
            self.times: list[float] = []
            self.prompt_seen = False

        def put(self, value):
            if not self.prompt_seen:  # generate() puts the prompt first
                self.prompt_seen = True
                return
            self.times.extend([time.perf_counter()] * value.numel())

        def end(self):
            pass

    model, load_s, source = _hf_model(spec)
    _hf_warmup(model, spec, batched=False)
    rss_loaded = rss_mib()
    reset_ok = reset_peak_rss()
    runs, tokens = [], []
    for prompt in spec["workload"]["b1_prompts"]:
        clock = Clock()
        start = time.perf_counter()
        tokens.append(_hf_generate_one(model, prompt, spec["b1_new"], streamer=clock))
        runs.append(b1_numbers(start, clock.times))
    measure_peak = hwm_mib() if reset_ok else None
    w = spec["workload"]
    check = {str(i): _hf_generate_one(model, w["prompts"][i], w["output_lens"][i]) for i in spec["check_indices"]}
    return {**_b1_summary(runs), "load_s": load_s, "load_source": source, "tokens": tokens, "check_tokens": check,
            "rss_after_load_mib": rss_loaded, "measure_peak_rss_mib": measure_peak}


# ---------------------------------------------------------------------------------------- TTFT

# kvgate rows of the TTFT phase: engine settings on top of the defaults (--model's file)
TTFT_ENGINES = {
    "kvgate fp32 (engine defaults)": {},
    "kvgate int4 (make serve: quantization gguf)": {"quantization": "gguf"},
    "kvgate int4, prefill_attention fp32": {"quantization": "gguf", "prefill_attention": "fp32"},
    "kvgate int4, prefill_matmul fp32": {"quantization": "gguf", "prefill_matmul": "fp32"},
}
HF_TTFT = {"transformers fp32": "float32", "transformers bf16": "bfloat16"}


def hf_ttft_worker(conn, spec: dict) -> None:
    """transformers' forward pass of a prompt and its first token (greedy), in fp32 and in bf16:
    answers ("ttft", prompt, dtype) with {"ttft_s", "prompt_tokens"} until ("stop",)."""
    import copy

    import torch

    torch.set_num_threads(spec["threads"])
    model, _, _ = _hf_model(spec)
    models = {"float32": model, "bfloat16": copy.deepcopy(model).to(torch.bfloat16)}
    conn.send({"ready": True})
    while (cmd := conn.recv())[0] != "stop":
        ids = torch.tensor([cmd[1]], dtype=torch.long)
        started = time.perf_counter()
        with torch.inference_mode():
            int(models[cmd[2]](input_ids=ids, logits_to_keep=1).logits[0, -1].argmax())
        conn.send({"ttft_s": time.perf_counter() - started, "prompt_tokens": len(cmd[1])})


class _DtypeConn:
    """One transformers dtype as a TTFT row: its commands carry the dtype to the shared worker."""

    def __init__(self, conn, dtype: str):
        self.conn, self.dtype = conn, dtype

    def send(self, cmd) -> None:
        self.conn.send((*cmd, self.dtype) if cmd[0] == "ttft" else cmd)

    def recv(self):
        return self.conn.recv()


def ttft_phase(args, spec: dict, workdir: Path) -> dict:
    """Time to first token of one 128 / 1,024 / 4,096-token prompt on every system, interleaved
    (bench/awq_speed.py's rounds): kvgate's engines (TTFT_ENGINES, one worker process each),
    transformers fp32 and bf16 (one worker), llama.cpp on the same GGUF when its venv is built."""
    import multiprocessing

    from awq_speed import TTFT_LENGTHS, _LlamaCpp, _ttft_prompts, _ttft_rounds, _worker, llama_cpp_python

    ctx = multiprocessing.get_context("spawn")
    workers, procs = {}, []
    kv_bytes = max(TTFT_LENGTHS) * 2 * 46080  # two longest prompts of the default model's float32 KV
    for name, settings in TTFT_ENGINES.items():
        parent, child = ctx.Pipe()
        procs.append(ctx.Process(target=_worker, args=(child, spec["model"], settings, spec["threads"], kv_bytes)))
        workers[name] = (parent, procs[-1])
    hf_parent, hf_child = ctx.Pipe()
    hf_spec = {**spec, "hf_cache_dir": str(workdir / "hf-model")}
    procs.append(ctx.Process(target=hf_ttft_worker, args=(hf_child, hf_spec)))
    for p in procs:
        p.start()
    rows = {name: {"engine": conn.recv()} for name, (conn, _) in workers.items()}
    hf_parent.recv()
    for name, dtype in HF_TTFT.items():
        workers[name] = (_DtypeConn(hf_parent, dtype), None)
        rows[name] = {"engine": f"transformers {dtype}"}
    llama = llama_cpp_python()
    if llama:
        anchor = _LlamaCpp(llama, spec["model"], spec["threads"])
        workers["llama.cpp (same GGUF)"] = (anchor, anchor)
        rows["llama.cpp (same GGUF)"] = {"engine": anchor.ready}
    try:
        _ttft_rounds(rows, workers, list(workers), _ttft_prompts(spec["workload"], args.ttft_repeats + 1))
    finally:
        for conn in [workers[name][0] for name in TTFT_ENGINES] + [hf_parent] + ([anchor] if llama else []):
            conn.send(("stop",))
        for p in procs:
            p.join(60)
        if llama:
            anchor.join(60)
    for row in rows.values():
        row["ttft_s"] = {str(n): statistics.median(r["ttft_s"] for r in row.get("ttft_runs", [])
                                                   if r["prompt_tokens"] == n) for n in TTFT_LENGTHS}
    return rows


def print_ttft(ttft: dict) -> None:
    print("\ntime to first token, s (median; one prompt, nothing cached)")
    lengths = list(next(iter(ttft.values()))["ttft_s"])
    print(f"{'system':<46}" + "".join(f"{n + ' tokens':>14}" for n in lengths))
    for name, row in ttft.items():
        print(f"{name:<46}" + "".join(f"{row['ttft_s'][n]:>14.3f}" for n in lengths))


# ---------------------------------------------------------------------------------------- parent


def run_child(name: str, spec: dict, workdir: Path, tag: str | None = None) -> dict:
    """Child `name` (a function of child_main) on `spec`; `tag` names a variant's files (hf in bf16)."""
    spec_path = workdir / f"{tag or name}.spec.json"
    spec_path.write_text(json.dumps(spec))
    result_path = workdir / f"{tag or name}.result.json"
    result_path.unlink(missing_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(spec["threads"]), "MKL_NUM_THREADS": str(spec["threads"]),
           "TOKENIZERS_PARALLELISM": "false", "TRANSFORMERS_VERBOSITY": "error",
           "HF_HUB_DISABLE_PROGRESS_BARS": "1", "TQDM_DISABLE": "1", "PYTHONUNBUFFERED": "1"}
    print(f"[{time.strftime('%H:%M:%S')}] {tag or name} ...", flush=True)
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, __file__, "--child", name, "--spec", str(spec_path),
                           "--result", str(result_path)], env=env, cwd=ROOT)
    if proc.returncode != 0 or not result_path.exists():
        raise SystemExit(f"child {name} failed (exit {proc.returncode})")
    result = json.loads(result_path.read_text())
    result["child_wall_s"] = time.perf_counter() - started
    summary = {k: round(v, 2) for k, v in result.items() if k in ("out_tok_s", "decode_tok_s", "wall_s", "load_s")}
    print(f"[{time.strftime('%H:%M:%S')}] {tag or name} done in {result['child_wall_s']:.0f} s: {summary}", flush=True)
    return result


def serve_settings() -> dict:
    """configs/default.yaml's native deployment settings (what `make serve` runs), its model aside."""
    import yaml

    config = yaml.safe_load((ROOT / "configs/default.yaml").read_text())
    [native] = [d for m in config["models"] for d in m["deployments"] if d["backend"] == "native"]
    return {k: v for k, v in native["settings"].items() if k != "model"}


def llamacpp_runs(spec: dict) -> tuple[list[dict], list[dict]]:
    """llama.cpp (bench/llamacpp_b1.py in its venv) on the same GGUF and threads: the C2 workload's
    requests one after another, and batch-1 decode on the b1 prompts (([c2 result], [b1 result]))."""
    from awq_speed import _LlamaCpp, llama_cpp_python

    python = llama_cpp_python()
    if not python:
        raise SystemExit("--llamacpp: llama.cpp's venv is not built (bash bench/llamacpp_server.sh install)")
    print(f"[{time.strftime('%H:%M:%S')}] llama.cpp ...", flush=True)
    anchor = _LlamaCpp(python, spec["model"], spec["threads"])
    try:
        w = spec["workload"]
        anchor.send(("b1", w["warmup_prompts"][0], 8))  # warm-up, not timed
        anchor.recv()
        anchor.send(("c2", w["prompts"], w["output_lens"]))
        c2 = {**anchor.recv(), "engine": anchor.ready}
        b1 = []
        for prompt in w["b1_prompts"]:
            anchor.send(("b1", prompt, spec["b1_new"]))
            b1.append(anchor.recv())
    finally:
        anchor.send(("stop",))
        anchor.join(60)
    print(f"[{time.strftime('%H:%M:%S')}] llama.cpp done: C2 {c2['out_tok_s']:.1f} tok/s (one at a time), "
          f"batch-1 {statistics.median(r['decode_tok_s'] for r in b1):.1f} tok/s", flush=True)
    return [c2], [{"decode_tok_s": statistics.median(r["decode_tok_s"] for r in b1), "runs": b1}]


def median_of(results: list[dict], key: str):
    values = [r[key] for r in results if r.get(key) is not None]
    return statistics.median(values) if values else None


def strip_tokens(result: dict) -> dict:
    return {k: v for k, v in result.items() if k not in ("tokens", "check_tokens")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 8 requests, prompts 32-128, outputs 16-48, batch-1 32 new tokens x 2")
    parser.add_argument("--requests", type=int, help="number of requests (default 64; --quick: 8)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2, help="torch threads in every child")
    parser.add_argument("--repeats", type=int, default=1, help="throughput runs per system (fresh process each); median")
    parser.add_argument("--skip-sequential", action="store_true", help="skip hf_sequential (slow: ~10 min for 64)")
    parser.add_argument("--skip-hf", action="store_true", help="kvgate only (no ratios, no cross-check)")
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--skip-hf-bf16", action="store_true",
                        help="skip transformers in bfloat16 (static batches and batch-1; fp32 always runs)")
    parser.add_argument("--skip-ttft", action="store_true", help="skip the TTFT rows (128 / 1k / 4k-token prompts)")
    parser.add_argument("--ttft-only", action="store_true", help="only the TTFT rows")
    parser.add_argument("--ttft-repeats", type=int, default=3, help="TTFT rounds, each on every system; median")
    parser.add_argument("--check", type=int, default=4,
                        help="requests cross-checked one at a time by transformers when hf_sequential is skipped")
    parser.add_argument("--b1-prompt", type=int, default=128)
    parser.add_argument("--b1-new", type=int, help="batch-1 new tokens (default 128; --quick: 32)")
    parser.add_argument("--b1-repeats", type=int, help="batch-1 runs, one prompt each (default 3; --quick: 2)")
    parser.add_argument("--max-num-seqs", type=int, help="engine override (default: EngineConfig's)")
    parser.add_argument("--max-num-batched-tokens", type=int, help="engine override (default: EngineConfig's)")
    parser.add_argument("--kv-cache-mib", type=int, help="engine KV-cache budget override (CPU default: 2 GiB)")
    parser.add_argument("--model", help="GGUF path (default: native_backend.model.loader.default_gguf_path())")
    parser.add_argument("--serve-config", action="store_true",
                        help="kvgate's C2 and batch-1 engine as `make serve` runs it: configs/default.yaml's native "
                             "settings (int4 GGUF, max_num_seqs 32, ...), the other overrides on top")
    parser.add_argument("--llamacpp", action="store_true",
                        help="also llama.cpp on the same GGUF (its venv: bench/llamacpp_server.sh install): batch-1 "
                             "on the same prompts, and the C2 requests one after another (it does not batch)")
    parser.add_argument("--out", help="JSON path (default bench/results/engine_throughput.json, "
                                      "--quick: engine_throughput_quick.json)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child_main(args.child, args.spec, args.result)

    q = args.quick
    args.requests = args.requests or (8 if q else 64)
    args.prompt_min, args.prompt_max = (32, 128) if q else (64, 512)
    args.output_min, args.output_max = (16, 48) if q else (64, 256)
    args.b1_new = args.b1_new or (32 if q else 128)
    args.b1_repeats = args.b1_repeats or (2 if q else 3)
    out_path = Path(args.out or ROOT / "bench/results" / ("engine_throughput_quick.json" if q else "engine_throughput.json"))

    from native_backend.model.loader import default_gguf_path

    model_path = args.model or default_gguf_path()
    overrides = serve_settings() if args.serve_config else {}
    if args.max_num_seqs:
        overrides["max_num_seqs"] = args.max_num_seqs
    if args.max_num_batched_tokens:
        overrides["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.kv_cache_mib:
        overrides["kv_cache_bytes"] = args.kv_cache_mib << 20

    workload = build_workload(args, model_path)
    n = args.requests
    # The cheapest requests (prompt + output) for the one-at-a-time cross-check.
    cost = sorted(range(n), key=lambda i: (workload["output_lens"][i], len(workload["prompts"][i])))
    check_indices = [] if (args.skip_hf or not args.skip_sequential) else sorted(cost[:min(args.check, n)])
    load1 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="kvgate-engine-bench-") as tmp:
        workdir = Path(tmp)
        spec = {"model": model_path, "threads": args.threads, "workload": workload, "engine_overrides": overrides,
                "hf_batch_size": args.hf_batch_size, "b1_new": args.b1_new, "check_indices": check_indices,
                "hf_cache_dir": str(workdir / "hf-model")}
        print(f"workload {workload['sha256']}: {n} requests, prompts {sum(map(len, workload['prompts']))} tokens, "
              f"outputs {sum(workload['output_lens'])} tokens; load average {load1:.2f}", flush=True)
        ttft = None if args.skip_ttft else ttft_phase(args, spec, workdir)
        if args.ttft_only:
            report = {"ttft": ttft, "git": git_info(), "machine": machine(load1), "versions": package_versions()}
            out_path = Path(args.out or ROOT / "bench/results/engine_throughput_ttft.json")
            print_ttft(ttft)
            out_path.write_text(json.dumps(report, indent=2))
            print(f"wrote {out_path}")
            return
        runs: dict[str, list[dict]] = {"kvgate": [run_child("kvgate", spec, workdir) for _ in range(args.repeats)]}
        runs["kvgate_batch1"] = [run_child("kvgate_batch1", spec, workdir)]
        if not args.skip_hf:
            runs["hf_static16"] = [run_child("hf_static", spec, workdir) for _ in range(args.repeats)]
            runs["hf_batch1"] = [run_child("hf_batch1", spec, workdir)]
            if not args.skip_hf_bf16:
                bf16 = {**spec, "hf_dtype": "bfloat16", "check_indices": []}
                runs["hf_static16_bf16"] = [run_child("hf_static", bf16, workdir, "hf_static_bf16")
                                            for _ in range(args.repeats)]
                runs["hf_batch1_bf16"] = [run_child("hf_batch1", bf16, workdir, "hf_batch1_bf16")]
            if not args.skip_sequential:
                runs["hf_sequential"] = [run_child("hf_sequential", spec, workdir) for _ in range(args.repeats)]
        if args.llamacpp:
            runs["llamacpp"], runs["llamacpp_batch1"] = llamacpp_runs(spec)

    report = summarize(args, workload, model_path, overrides, runs, check_indices, load1)
    report["ttft"] = ttft
    print_table(report)
    if ttft:
        print_ttft(ttft)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(report, indent=2))
    print(f"wrote {out_path}")


def summarize(args, workload, model_path, overrides, runs, check_indices, load1) -> dict:
    def med(system, key="out_tok_s"):
        return median_of(runs[system], key) if system in runs else None

    def ratio(a, b):
        return a / b if a and b else None

    ours = dict(enumerate(runs["kvgate"][0]["tokens"]))
    check = {}
    if "hf_sequential" in runs:
        check["kvgate_vs_hf_sequential"] = compare(ours, dict(enumerate(runs["hf_sequential"][0]["tokens"])))
    if "hf_batch1" in runs:
        if check_indices:
            check["kvgate_vs_hf_one_at_a_time"] = compare(
                ours, {int(i): t for i, t in runs["hf_batch1"][0]["check_tokens"].items()})
        check["kvgate_vs_hf_batch1_prompts"] = compare(dict(enumerate(runs["kvgate_batch1"][0]["tokens"])),
                                                       dict(enumerate(runs["hf_batch1"][0]["tokens"])))
    if "hf_static16" in runs:
        check["kvgate_vs_hf_static16_padded"] = compare(ours, dict(enumerate(runs["hf_static16"][0]["tokens"])))
    if len(runs["kvgate"]) > 1:  # greedy and batch-invariant? at least run-to-run identical
        check["kvgate_run_to_run"] = compare(ours, dict(enumerate(runs["kvgate"][1]["tokens"])))

    kv, st, seq = med("kvgate"), med("hf_static16"), med("hf_sequential")
    kv_b1, hf_b1 = med("kvgate_batch1", "decode_tok_s"), med("hf_batch1", "decode_tok_s")
    return {
        "tok_s_counts": "output tokens only (prompt tokens not counted) per second of wall time, warm-up excluded; "
                        "hf_static16 counts each request's own output length (padding tail excluded)",
        "kvgate_out_tok_s": kv,
        "hf_static16_out_tok_s": st,
        "hf_sequential_out_tok_s": seq,
        "ratio_vs_hf_static16": ratio(kv, st),
        "hf_static16_bf16_out_tok_s": med("hf_static16_bf16"),
        "ratio_vs_hf_static16_bf16": ratio(kv, med("hf_static16_bf16")),
        "ratio_vs_hf_sequential": ratio(kv, seq),
        "llamacpp_one_at_a_time_out_tok_s": med("llamacpp"),
        "ratio_vs_llamacpp": ratio(kv, med("llamacpp")),
        "hf_static16_computed_tok_s": med("hf_static16", "computed_tok_s"),
        "wall_s": {s: med(s, "wall_s") for s in ("kvgate", "hf_static16", "hf_static16_bf16", "hf_sequential")
                   if s in runs},
        # kvgate's median run (by output tok/s) under `vllm bench serve --save-result`'s keys.
        "kvgate_vllm_bench_serve": sorted(runs["kvgate"], key=lambda r: r["out_tok_s"])[len(runs["kvgate"]) // 2][
            "vllm_bench_serve"],
        "batch1": {
            "definition": f"{args.b1_prompt}-token prompt, {args.b1_new} new tokens, greedy; decode_tok_s = "
                          "(new - 1) / (last token time - first token time), prefill and first token excluded; "
                          f"median of {args.b1_repeats} prompts",
            "kvgate_decode_tok_s": kv_b1,
            "hf_decode_tok_s": hf_b1,
            "ratio_decode": ratio(kv_b1, hf_b1),
            "kvgate_total_tok_s": med("kvgate_batch1", "total_tok_s"),
            "hf_total_tok_s": med("hf_batch1", "total_tok_s"),
            "kvgate_ttft_s": med("kvgate_batch1", "ttft_s"),
            "hf_ttft_s": med("hf_batch1", "ttft_s"),
            "hf_bf16_decode_tok_s": med("hf_batch1_bf16", "decode_tok_s"),
            "hf_bf16_ttft_s": med("hf_batch1_bf16", "ttft_s"),
            "llamacpp_decode_tok_s": med("llamacpp_batch1", "decode_tok_s"),
            "ratio_vs_llamacpp": ratio(kv_b1, med("llamacpp_batch1", "decode_tok_s")),
        },
        "peak_rss_note": "each system in its own process; measurement_phase = peak RSS after load and warm-up "
                         "(VmHWM reset), whole_child includes loading (hf: the first hf child converts the GGUF, the "
                         "others load its cached fp32 state dict); kvgate's includes its zero-filled KV cache",
        "peak_rss_mib": {s: {"whole_child": median_of(r, "peak_rss_mib"),
                             "after_load": median_of(r, "rss_after_load_mib"),
                             "measurement_phase": median_of(r, "measure_peak_rss_mib")} for s, r in runs.items()},
        "correctness": check,
        "anchors_tok_s": ANCHORS,
        "config": {
            "model": model_path, "dtype": "float32", "device": "cpu", "threads": args.threads,
            "serve_config": args.serve_config,
            "requests": args.requests, "prompt_len": [args.prompt_min, args.prompt_max],
            "output_len": [args.output_min, args.output_max], "hf_batch_size": args.hf_batch_size,
            "repeats": args.repeats, "engine_overrides": overrides, "quick": args.quick,
            "engine": runs["kvgate"][0].get("engine"),
            "hf_attn_implementation": runs["hf_static16"][0].get("attn_implementation") if "hf_static16" in runs else None,
        },
        "seed": args.seed,
        "workload": {"sha256": workload["sha256"], "prompt_tokens": sum(map(len, workload["prompts"])),
                     "output_tokens": sum(workload["output_lens"]), "text_tokens": workload["text_tokens"],
                     "prompt_lens": [len(p) for p in workload["prompts"]], "output_lens": workload["output_lens"],
                     "offsets": workload["offsets"], "check_indices": check_indices},
        "git": git_info(),
        "machine": machine(load1),
        "python": sys.version.split()[0],
        "versions": package_versions(),
        "runs": {s: [strip_tokens(r) for r in rs] for s, rs in runs.items()},
    }


def machine(load1: float) -> dict:
    from native_backend.model.layers.prefill_matmul import bf16_unit

    return {"cpus": os.cpu_count(), "bf16_matrix_unit": bf16_unit(), "load_average_at_start": load1,
            "load_average_at_end": os.getloadavg()[0]}


def package_versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("torch", "transformers", "gguf", "tokenizers"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out


def print_table(r: dict) -> None:
    def f(x, spec=".1f"):
        return "-" if x is None else format(x, spec)

    rss = r["peak_rss_mib"]

    def peak(s):
        return f"{f(rss.get(s, {}).get('measurement_phase'), '.0f')} / {f(rss.get(s, {}).get('whole_child'), '.0f')}"

    c = r["config"]
    print()
    print(f"SmolLM2-135M fp32 CPU, {c['threads']} threads; {c['requests']} requests, prompts {c['prompt_len']}, "
          f"outputs {c['output_len']}; tok/s = OUTPUT tokens per second (warm-up excluded)")
    print(f"{'system':<16}{'out tok/s':>11}{'wall s':>9}{'kvgate x':>10}   peak RSS MiB (measure / whole child)")
    rows = [("kvgate", r["kvgate_out_tok_s"], None), ("hf_static16", r["hf_static16_out_tok_s"], r["ratio_vs_hf_static16"]),
            ("hf_static16_bf16", r["hf_static16_bf16_out_tok_s"], r["ratio_vs_hf_static16_bf16"]),
            ("hf_sequential", r["hf_sequential_out_tok_s"], r["ratio_vs_hf_sequential"]),
            ("llamacpp", r["llamacpp_one_at_a_time_out_tok_s"], r["ratio_vs_llamacpp"])]
    for name, tps, ratio in rows:
        print(f"{name:<16}{f(tps):>11}{f(r['wall_s'].get(name)):>9}{f(ratio, '.2f'):>10}   {peak(name)}")
    b = r["batch1"]
    print(f"batch-1 decode ({b['definition'].split(';')[0]}): kvgate {f(b['kvgate_decode_tok_s'])} tok/s, "
          f"transformers {f(b['hf_decode_tok_s'])} tok/s, ratio {f(b['ratio_decode'], '.2f')}; "
          f"TTFT {f(b['kvgate_ttft_s'], '.3f')} s vs {f(b['hf_ttft_s'], '.3f')} s; "
          f"peak RSS kvgate {peak('kvgate_batch1')}, hf {peak('hf_batch1')}")
    if b["hf_bf16_decode_tok_s"]:
        print(f"transformers bf16 batch-1: {f(b['hf_bf16_decode_tok_s'])} tok/s, TTFT {f(b['hf_bf16_ttft_s'], '.3f')} s")
    if b["llamacpp_decode_tok_s"]:
        print(f"llama.cpp batch-1: {f(b['llamacpp_decode_tok_s'])} tok/s (kvgate {f(b['ratio_vs_llamacpp'], '.2f')}x)")
    if r["hf_static16_computed_tok_s"]:
        print(f"hf_static16 including the padding tail: {f(r['hf_static16_computed_tok_s'])} tok/s generated")
    for name, res in r["correctness"].items():
        line = f"check {name}: {res['identical']}/{res['compared']} identical"
        if res["divergent"]:
            line += "; divergent (request: matching prefix/length): " + ", ".join(
                f"{d['request']}: {d['matching_prefix']}/{d['length']}" for d in res["divergent"][:12])
        print(line)
    for name, rs in r["runs"].items():
        bad = [x for x in rs if x.get("lengths_ok") is False]
        if bad:
            print(f"WARNING: {name} produced output lengths other than requested")
    print(f"anchors (ANCHORS.md, 2-core box): {r['anchors_tok_s']}")
    print(f"load average at start {r['machine']['load_average_at_start']:.2f}, end {r['machine']['load_average_at_end']:.2f}; "
          f"git {str(r['git']['commit'])[:10]}{' (dirty)' if r['git']['dirty_paths'] else ''}")


if __name__ == "__main__":
    main()
