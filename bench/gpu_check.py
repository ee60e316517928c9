"""One GPU check of the CUDA side, for whenever an NVIDIA GPU is lent: under 8 minutes on one H200.

Writes `bench/results/gpu_check.json` (after every section, so a run cut short keeps what it
measured) and prints a summary. Without a CUDA GPU it prints why and exits 0, writing nothing.

1. kernels: every Triton kernel against the torch reference on CUDA, over ragged batches
   (decode-only, whole prefills, chunked prefills mixed with decodes over cached blocks), GQA
   shapes of SmolLM2 (9/3 heads, head_dim 64) and Llama (32/8, 128; MQA 8/1, 128; head_dim 80),
   block sizes 16 and 32, and every KV-cache element type `native_backend.model.kv_cache.KV_CACHE_DTYPES`
   lists (quantized ones included once they are registered there). Modules of `native_backend`
   that define `gpu_selfcheck(device) -> dict` (e.g. an AWQ GEMM against its dequantized
   reference) are found and run too.
2. parity: the engine on CUDA, greedy, against transformers on the same GPU: 16 prompts of real
   text (bench/engine_throughput.py's workload), 32 new tokens each, EOS ignored; bf16 (the
   serving precision; a near-tie may flip a late token) and fp32 (which must match exactly).
3. throughput: the engine_throughput workload (64 requests, prompts 64-512, outputs 64-256 token
   ids of real text, fixed seed) through the engine (all at t=0, step until done) against
   transformers' padded static batches of 16, bf16, same GPU, warm-up excluded. tok/s counts
   OUTPUT tokens per second of wall time.
4. structured: constrained decoding on CUDA (issue 28): a batch of the battery's prompts
   (bench/structured.py's C2-style batch, bf16) with every request constrained by its JSON schema,
   then the same batch unconstrained making as many tokens per request: every complete constrained output validates (`jsonschema`),
   the masks go through the Triton kernel (token_mask_triton; its own check against the CPU path
   runs in section 1), output tok/s with and without, and the mask's cost per constrained row and
   step (fill on the host, apply on the GPU, synchronised).
5. bandwidth: batch-1 decode of a random-weight 1B-class Llama (Llama-3.2-1B's shape, bf16) at a
   512-token context: bytes read per token (weights once, lm_head included, plus the KV read) x
   tokens/s / the GPU's peak bandwidth (H200 4.8 TB/s). With and without CUDA graphs when the
   engine's runner has them (it does not yet: reported as such).
6. trtllm: tests/plugins/test_tensorrt_llm_contract.py with tensorrt_llm required: the stand-in
   the TensorRT-LLM adapter's tests use has the real package's fields, keywords and defaults.

    .venv/bin/python bench/gpu_check.py                 # everything
    .venv/bin/python bench/gpu_check.py --only kernels  # one section
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import pkgutil
import platform
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "bench"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

OUT = ROOT / "bench" / "results" / "gpu_check.json"
SECTIONS = ("kernels", "parity", "throughput", "structured", "bandwidth", "trtllm")
PEAK_TBPS = {"H200": 4.8, "H100 SXM": 3.35, "H100 PCIe": 2.0, "H100": 3.35, "A100-SXM4-80GB": 2.04,
             "A100": 1.55, "L40S": 0.864, "L4": 0.3}
# Llama-3.2-1B's shape: 1.24 B parameters, tied embeddings, GQA 32/8, head_dim 64.
LLAMA_1B = dict(vocab_size=128256, hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64,
                intermediate_size=8192, rope_theta=500000.0, max_position_embeddings=8192,
                tie_word_embeddings=True)
# (context_len, query_len) per sequence: cached context = context - query.
SHAPES = {
    "decode": [(1, 1), (15, 1), (16, 1), (17, 1), (300, 1), (1027, 1), (4096, 1)],
    "prefill": [(37, 37), (128, 128), (513, 513)],
    "chunked": [(300, 44), (64, 1), (513, 200), (16, 16), (1000, 1), (2048, 512)],
}
HEADS = [(3, 3, 64), (8, 4, 128), (1, 8, 128), (2, 2, 80)]  # (kv heads, queries per kv head, head_dim)
BLOCK_SIZES = (16, 32)
TOLERANCE = {"float32": 2e-3, "float16": 1e-2, "bfloat16": 4e-2}  # max |triton - reference|


# ------------------------------------------------------------------------------------- kernels


def attention_cases(shapes=SHAPES, heads=HEADS, block_sizes=BLOCK_SIZES):
    for kind, seqs in shapes.items():
        for num_kv_heads, group, head_dim in heads:
            for block_size in block_sizes:
                yield kind, seqs, dict(num_kv_heads=num_kv_heads, group=group, head_dim=head_dim,
                                       block_size=block_size)


def check_attention_case(kernel, reference, seqs, shape: dict, kv_dtype, device) -> dict:
    """One ragged batch: the kernel's write_kv and paged_attention against the reference's, on
    the same inputs (the case comes from tests/support/data/attention_cases.py, built on the CPU)."""
    import torch
    from tests.support.data.attention_cases import make_case

    from native_backend.model.attention.metadata import AttentionMetadata

    q, ks, vs, cache_k, cache_v, md = make_case(seqs, cache_dtype=kv_dtype.storage, **shape)
    md = AttentionMetadata.build(query_lens=md.query_lens_cpu, context_lens=md.context_lens_cpu,
                                 block_tables=_tables(md), block_size=md.block_size, device=device)
    # Queries in the cache's own float type; a one-byte (quantized) cache serves bf16 models.
    dtype = kv_dtype.storage if kv_dtype.storage.is_floating_point and kv_dtype.storage.itemsize > 1 else torch.bfloat16
    q = q.to(device, dtype)
    k_new = torch.cat([k[c - n:] for k, (c, n) in zip(ks, seqs)]).to(device, dtype)
    v_new = torch.cat([v[c - n:] for v, (c, n) in zip(vs, seqs)]).to(device, dtype)
    caches = {}
    for name, impl in (("kernel", kernel), ("reference", reference)):
        layer = _kv_layer(cache_k.to(device).clone(), cache_v.to(device).clone(), kv_dtype)
        impl.write_kv(k_new, v_new, layer, md.slot_mapping)
        caches[name] = (layer, impl.paged_attention(q, layer, md, shape["head_dim"] ** -0.5))
    (ours, got), (ref, want) = caches["kernel"], caches["reference"]
    write_err = max(_max_err(_stored(ours.key), _stored(ref.key)), _max_err(_stored(ours.value), _stored(ref.value)))
    if ours.key_scales is not None:
        write_err = max(write_err, _max_err(ours.key_scales, ref.key_scales), _max_err(ours.value_scales, ref.value_scales))
    attn_err = _max_err(got, want)
    tol = TOLERANCE.get(kv_dtype.name, 5e-2)
    return {"write_kv_max_err": write_err, "attention_max_err": attn_err, "tolerance": tol,
            "ok": write_err == 0.0 and attn_err <= tol}


def _kv_layer(cache_k, cache_v, kv_dtype):
    """The layer object the backends take; quantized formats get fixed per-layer scales (fp8) or
    zeroed per-row scales (int8) so that both implementations start from the same state."""
    import torch

    from native_backend.model.kv_cache import KVLayer

    layer = KVLayer(cache_k, cache_v, kv_dtype)
    if kv_dtype.scaling == "per_layer":
        layer.k_scale, layer.v_scale = 0.05, 0.02
    elif kv_dtype.scaling == "per_token_head":
        layer.key_scales = torch.zeros(cache_k.shape[:3], dtype=torch.float32, device=cache_k.device)
        layer.value_scales = torch.zeros_like(layer.key_scales)
    return layer


def _stored(t):
    """A cache's stored values as numbers to compare (fp8 by its bytes: the encoding must match)."""
    from native_backend.model.attention.kv_quant import as_bytes

    return as_bytes(t)


def _tables(md) -> list[list[int]]:
    blocks = [-(-c // md.block_size) for c in md.context_lens_cpu]
    return [row[:n] for row, n in zip(md.block_tables.tolist(), blocks)]


def _max_err(a, b) -> float:
    return float((a.float() - b.float()).abs().max()) if a.numel() else 0.0


def kernel_checks(device, kernel_name: str = "triton", cases=None, with_selfchecks: bool = True) -> dict:
    """Every case for every KV element type; an element type whose case cannot run is reported
    with its error (e.g. a quantized format whose kernels take arguments this check does not
    know yet), not hidden."""
    from native_backend.model.attention import get_attention_backend
    from native_backend.model.kv_cache import KV_CACHE_DTYPES

    kernel, reference = get_attention_backend(device, kernel_name), get_attention_backend(device, "reference")
    results = []
    for kv_dtype in KV_CACHE_DTYPES.values():
        for kind, seqs, shape in cases if cases is not None else attention_cases():
            row = {"kv_dtype": kv_dtype.name, "kind": kind, "seqs": seqs, **shape}
            try:
                row.update(check_attention_case(kernel, reference, seqs, shape, kv_dtype, device))
            except Exception as exc:  # noqa: BLE001 - reported, and the other cases still run
                row.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:300])
            results.append(row)
    failed = [r for r in results if not r["ok"]]
    extra = selfchecks(device) if with_selfchecks else {}
    return {"kernel": kernel_name, "cases": len(results), "failed": len(failed), "results": results,
            "selfchecks": extra, "ok": not failed and all(c.get("ok") for c in extra.values())}


def selfchecks(device) -> dict:
    """`gpu_selfcheck(device)` of every native_backend module that defines one."""
    import native_backend

    found = {}
    for info in pkgutil.walk_packages(native_backend.__path__, "native_backend."):
        try:
            module = importlib.import_module(info.name)
        except Exception:  # noqa: BLE001 - a module that does not import here is not ours to check
            continue
        check = getattr(module, "gpu_selfcheck", None)
        if callable(check):
            try:
                found[info.name] = check(device)
            except Exception as exc:  # noqa: BLE001
                found[info.name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:300]}
    return found


# -------------------------------------------------------------------------------- transformers


def hf_greedy(model, prompt: list[int], new_tokens: int) -> list[int]:
    """transformers' greedy tokens for one prompt, EOS ignored (no stop, nothing suppressed)."""
    import torch

    ids = torch.tensor([prompt], device=model.device)
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def hf_padded_greedy(model, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """One static batch, left-padded with an attention mask (transformers' batched serving)."""
    import torch

    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + list(p) for p in prompts], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[:, width:].tolist()


def hf_smollm2(model_path: str):
    """transformers' own GGUF load (fp32, on the CPU); cast and moved per section."""
    import os

    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(model_path), gguf_file=os.path.basename(model_path),
                                                 dtype=torch.float32, attn_implementation="sdpa")
    return model.eval()


def on_device(hf_cpu, device, dtype):
    """A copy cast for one run: casting the loaded model itself in place would round its fp32
    weights through bf16 for the runs after."""
    import copy

    return copy.deepcopy(hf_cpu).to(device, dtype)


# -------------------------------------------------------------------------------------- engine


def engine(model_path: str, dtype: str, device: str = "cuda", **overrides):
    from native_backend.config.cache_dir import tokenizer_cache_dir
    from native_backend.config.engine import EngineConfig
    from native_backend.process.factory import make_engine_core

    settings = {"kv_cache_bytes": 8 << 30, **overrides}
    return make_engine_core(EngineConfig.build(path=model_path, device=device, dtype=dtype,
                                               tokenizer_cache_dir=str(tokenizer_cache_dir()), **settings))


def workload(model_path: str, requests: int, prompt_range, output_range) -> dict:
    from engine_runs import build_workload

    args = SimpleNamespace(seed=0, requests=requests, prompt_min=prompt_range[0], prompt_max=prompt_range[1],
                           output_min=output_range[0], output_max=output_range[1], b1_prompt=128, b1_repeats=1)
    return build_workload(args, model_path)


def parity(model_path: str, hf_cpu, prompts: int = 16, new_tokens: int = 32, device: str = "cuda",
           dtypes=("bfloat16", "float32")) -> dict:
    import torch
    from engine_runs import compare, kvgate_run

    w = workload(model_path, prompts, (32, 256), (new_tokens, new_tokens))
    out = {}
    for dtype in dtypes:
        ours_engine = engine(model_path, dtype, device, cpu_kernels=False)
        run = kvgate_run(ours_engine, w["prompts"], [new_tokens] * prompts, "p")
        ours = {i: run["tokens"][rid] for i, rid in enumerate(run["ids"])}
        del ours_engine
        hf = on_device(hf_cpu, device, getattr(torch, dtype))
        theirs = {i: hf_greedy(hf, p, new_tokens) for i, p in enumerate(w["prompts"])}
        del hf
        result = compare(ours, theirs)
        result["ok"] = result["identical"] == prompts
        out[dtype] = result
        _free_cuda()
    out["ok"] = out.get("float32", out[dtypes[-1]])["ok"]  # bf16 near-ties may flip late tokens; fp32 must not
    return out


def throughput(model_path: str, hf_cpu, batch: int = 16, requests: int = 64, device: str = "cuda",
               dtype: str = "bfloat16") -> dict:
    import torch
    from engine_runs import compare, kvgate_run

    w = workload(model_path, requests, (64, 512), (64, 256))
    overrides = dict(max_num_seqs=64, max_num_batched_tokens=2048)
    ours_engine = engine(model_path, dtype, device, **overrides)
    kvgate_run(ours_engine, w["warmup_prompts"], [8, 8], "warmup-")
    run = kvgate_run(ours_engine, w["prompts"], w["output_lens"], "r")
    ours = [run["tokens"][rid] for rid in run["ids"]]
    del ours_engine
    _free_cuda()
    hf = on_device(hf_cpu, device, getattr(torch, dtype))
    hf_padded_greedy(hf, w["warmup_prompts"], 8)
    _sync(device)
    start, theirs = time.perf_counter(), []
    for b in range(0, len(w["prompts"]), batch):
        outs = w["output_lens"][b:b + batch]
        generated = hf_padded_greedy(hf, w["prompts"][b:b + batch], max(outs))
        theirs.extend(g[:n] for g, n in zip(generated, outs))  # useful: each request's own length
    hf_wall = time.perf_counter() - start
    del hf
    _free_cuda()
    out_tokens = sum(w["output_lens"])
    ours_tps, hf_tps = sum(map(len, ours)) / run["wall"], out_tokens / hf_wall
    return {"workload_sha256": w["sha256"], "engine_overrides": overrides, "hf_batch_size": batch,
            "kvgate_out_tok_s": ours_tps, "hf_static_out_tok_s": hf_tps, "ratio": ours_tps / hf_tps,
            "kvgate_wall_s": run["wall"], "kvgate_steps": run["steps"], "hf_wall_s": hf_wall,
            "lengths_ok": [len(t) for t in ours] == w["output_lens"],
            "tokens_vs_hf_static": _summary(compare(dict(enumerate(ours)), dict(enumerate(theirs)))),
            "ok": [len(t) for t in ours] == w["output_lens"]}


def _summary(comparison: dict) -> dict:
    return {k: comparison[k] for k in ("compared", "identical")}


def _free_cuda() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------- structured


def structured(model_path: str, device: str = "cuda", dtype: str = "bfloat16", requests: int = 32,
               max_tokens: int = 64, warm_up: bool = True, first_schema: int = 0, **overrides) -> dict:
    """Every request constrained by its JSON schema, then the same batch unconstrained making as
    many tokens per request (after a warm-up in which the grammars and the Triton kernel compile).
    ok: some constrained outputs complete and every complete one validates."""
    from structured import MaskTimer, matched_batches, one_batch

    ours = engine(model_path, dtype, device, max_num_seqs=requests, max_num_batched_tokens=2048, **overrides)
    with MaskTimer() as timer:
        if warm_up:
            one_batch(ours, min(requests, 4), 8, True, seed=999)
            timer.reset()
        pair = matched_batches(ours, requests, max_tokens, seed=0, first=first_schema)
    on, off = pair["on"], pair["off"]
    del ours
    _free_cuda()
    return {"requests": requests, "max_tokens": max_tokens, "dtype": dtype, "unconstrained": off, "constrained": on,
            "ratio": on["tok_s"] / off["tok_s"], **timer.per_row(),
            "ok": on["complete"] > 0 and on["complete_valid"] == on["complete"]}


# ----------------------------------------------------------------------------------- bandwidth


def random_llama(config, device, dtype):
    """A Llama built in its final form with random weights (no checkpoint on disk)."""
    import torch

    from native_backend.model.layers.context import LayerContext
    from native_backend.model.loader import build_model
    from native_backend.model.models.llama import LlamaForCausalLM

    ctx = LayerContext.for_device(device, dtype, cpu_kernels=False)
    # The shapes from an empty model of this context (torch.empty: nothing is initialised).
    shapes = {k: v.shape for k, v in LlamaForCausalLM(config, ctx).state_dict().items()}
    g = torch.Generator(device=device).manual_seed(0)
    weights = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(shape, device=device, dtype=dtype)
        else:
            weights[name] = (torch.randn(shape, device=device, dtype=dtype, generator=g) * 0.02)
    return build_model(config, iter(weights.items()), ctx)


def bytes_per_decode_token(model, context_len: int, kv_bytes_per_element: int) -> dict:
    """What one batch-1 decode step must read: every weight once (the embedding table only as
    the lm_head's matrix when tied: the lookup itself reads one row) plus the KV of the context."""
    c = model.config
    seen, weights = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            weights += p.numel() * p.element_size()
    if not c.tie_word_embeddings:
        embed = model.model.embed_tokens.weight
        weights -= embed.numel() * embed.element_size()
    kv = 2 * c.num_layers * c.num_kv_heads * c.head_dim * kv_bytes_per_element * context_len
    return {"weights": weights, "kv": kv, "total": weights + kv}


def decode_step_times(model, device, dtype: str, context_len: int, steps: int, **runner_kwargs) -> list[float]:
    """Prefill a context_len-token prompt, then time `steps` greedy batch-1 decode steps."""
    import torch

    from native_backend.core.batch import ScheduledChunk, SchedulerOutput
    from native_backend.core.sampling_params import SamplingParams
    from native_backend.execution.model_runner import ModelRunner
    from native_backend.model.kv_cache import KVCache

    block = 16
    blocks = -(-(context_len + steps + 1) // block)
    cache = KVCache.for_model(model.config, num_blocks=blocks + 1, block_size=block, dtype=dtype, device=device)
    runner = ModelRunner(model, cache, device, **runner_kwargs)
    table, greedy = list(range(1, blocks + 1)), SamplingParams(temperature=0.0)
    prompt = [(7 * i) % model.config.vocab_size for i in range(context_len)]
    token = runner.execute(SchedulerOutput([ScheduledChunk("b1", prompt, 0, table, True, greedy)])).sampled_token_ids["b1"][0]
    times, pos = [], context_len
    for _ in range(steps):
        _sync(device)
        t0 = time.perf_counter()
        out = runner.execute(SchedulerOutput([ScheduledChunk("b1", [token], pos, table, True, greedy)]))
        token = out.sampled_token_ids["b1"][0]
        _sync(device)
        times.append(time.perf_counter() - t0)
        pos += 1
    return times


def _sync(device) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def cuda_graph_options() -> list[dict]:
    """Runner keyword arguments to compare: with and without CUDA graphs where the runner takes a
    `*graph*` switch; only the default where it does not."""
    from native_backend.execution.model_runner import ModelRunner

    switches = [p for p in inspect.signature(ModelRunner.__init__).parameters if "graph" in p]
    return [{}] if not switches else [{switches[0]: False}, {switches[0]: True}]


def bandwidth(device="cuda", context_len: int = 512, steps: int = 128, peak_tbps: float | None = None) -> dict:
    import torch

    from native_backend.config.model import ModelConfig

    model = random_llama(ModelConfig(**LLAMA_1B), device, torch.bfloat16)
    read = bytes_per_decode_token(model, context_len, 2)
    peak = peak_tbps or gpu_peak_tbps()
    runs = []
    for options in cuda_graph_options():
        times = decode_step_times(model, device, "bfloat16", context_len, steps, **options)
        step = statistics.median(times[8:])  # the first steps warm Triton's caches
        tok_s = 1.0 / step
        runs.append({"runner_options": options, "median_step_ms": step * 1e3, "tok_s": tok_s,
                     "achieved_tbps": read["total"] * tok_s / 1e12,
                     "utilisation": read["total"] * tok_s / (peak * 1e12) if peak else None})
    del model
    _free_cuda()
    return {"model": "random-weight Llama, Llama-3.2-1B shape, bf16", "context_len": context_len, "steps": steps,
            "bytes_per_token": read, "peak_tbps": peak, "runs": runs,
            "cuda_graphs": "compared" if len(runs) > 1 else "the engine's runner has no CUDA graphs yet",
            "ok": True}


def gpu_peak_tbps() -> float | None:
    import torch

    name = torch.cuda.get_device_name()
    for key, tbps in PEAK_TBPS.items():
        if key in name:
            return tbps
    return None


# -------------------------------------------------------------------------------------- driver


def gpu_info() -> dict:
    import torch

    props = torch.cuda.get_device_properties(0)
    info = {"name": props.name, "memory_gib": props.total_memory / 2**30, "capability": f"{props.major}.{props.minor}",
            "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version()}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    return info


def trtllm_contract() -> dict:
    """The TensorRT-LLM stand-in the adapter's tests run against, compared with the real package
    (tests/plugins/test_tensorrt_llm_contract.py) with the package required: a GPU machine without
    tensorrt_llm fails this section, saying so."""
    test = ROOT / "tests" / "plugins" / "test_tensorrt_llm_contract.py"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(test)], cwd=ROOT,
                          env={**os.environ, "KVGATE_REQUIRE_TRTLLM": "1"}, capture_output=True, text=True, timeout=600)
    # what docs/testing-ci.md records as the contract's last run: when, against which release
    return {"ok": proc.returncode == 0, "ran_at": time.strftime("%Y-%m-%d"),
            "tensorrt_llm": _package_version("tensorrt_llm"), "output": proc.stdout[-3000:]}


def _package_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def run_sections(names, args) -> dict:
    from native_backend.model.loader import default_gguf_path

    model_path = default_gguf_path()
    hf = None
    report = {"gpu": gpu_info(), "started": time.strftime("%Y-%m-%d %H:%M:%S"), "sections": {}}
    started = time.monotonic()
    for name in names:
        if time.monotonic() - started > args.budget_s:
            report["sections"][name] = {"ok": False, "skipped": f"time budget of {args.budget_s} s spent"}
            continue
        t0 = time.monotonic()
        try:
            if name in ("parity", "throughput") and hf is None:
                hf = hf_smollm2(model_path)
            result = {
                "kernels": lambda: kernel_checks("cuda"),
                "parity": lambda: parity(model_path, hf),
                "throughput": lambda: throughput(model_path, hf),
                "structured": lambda: structured(model_path),
                "bandwidth": lambda: bandwidth(peak_tbps=args.peak_tbps),
                "trtllm": trtllm_contract,
            }[name]()
        except Exception as exc:  # noqa: BLE001 - one section's failure is reported, the rest run
            result = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
        result["seconds"] = time.monotonic() - t0
        report["sections"][name] = result
        write(report, args.out)
        print(summary_line(name, result), flush=True)
    report["seconds"] = time.monotonic() - started
    write(report, args.out)
    return report


def write(report: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, default=str))


def summary_line(name: str, r: dict) -> str:
    head = f"{name:<11} {'ok  ' if r.get('ok') else 'FAIL'} {r.get('seconds', 0):6.1f} s"
    if "error" in r or "skipped" in r:
        return f"{head}  {r.get('error') or r.get('skipped')}"
    if name == "trtllm":
        return f"{head}  the stand-in {'declares' if r['ok'] else 'differs from'} what tensorrt_llm declares"
    if name == "kernels":
        worst = max((c.get("attention_max_err", 0) for c in r["results"]), default=0)
        return f"{head}  {r['cases'] - r['failed']}/{r['cases']} cases, worst attention error {worst:.2e}"
    if name == "parity":
        parts = [f"{d} {r[d]['identical']}/{r[d]['compared']}" for d in ("bfloat16", "float32") if d in r]
        return f"{head}  greedy sequences identical to transformers': {', '.join(parts)}"
    if name == "throughput":
        return (f"{head}  kvgate {r['kvgate_out_tok_s']:.0f} vs transformers {r['hf_static_out_tok_s']:.0f} "
                f"output tok/s ({r['ratio']:.2f}x)")
    if name == "structured":
        on = r["constrained"]
        return (f"{head}  {on['complete_valid']}/{on['complete']} complete constrained outputs valid; "
                f"{r['ratio']:.2f}x the unconstrained tok/s; mask {r['mask_fill_us_per_row']:.0f} us fill + "
                f"{r['mask_apply_us_per_row']:.0f} us apply per row")
    run = r["runs"][0]
    util = f"{run['utilisation']:.1%}" if run["utilisation"] is not None else "peak unknown"
    return f"{head}  {run['tok_s']:.0f} tok/s, {run['achieved_tbps']:.2f} TB/s, {util} of peak"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=SECTIONS, action="append", help="run this section (repeatable)")
    parser.add_argument("--out", type=Path, default=OUT, help=f"JSON path (default {OUT.relative_to(ROOT)})")
    parser.add_argument("--peak-tbps", type=float, help="the GPU's peak memory bandwidth (default: by its name)")
    parser.add_argument("--budget-s", type=float, default=450.0, help="skip the sections left after this long")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: skipped: no CUDA GPU here (torch.cuda.is_available() is False); nothing written.")
        return 0
    report = run_sections(args.only or SECTIONS, args)
    print(f"wrote {args.out} in {report['seconds']:.0f} s")
    return 0 if all(s.get("ok") for s in report["sections"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
