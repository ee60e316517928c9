"""The engine runs the benchmarks share: the pydoc-text workload (engine_throughput.py's C2 and
batch-1 prompts), an in-process engine stepped to completion with token arrival times, and the
comparisons of token lists. Imports no other benchmark, so every benchmark can import it."""

from __future__ import annotations

import hashlib
import json
import random
import time

WARMUP_REGION = 4096  # the first tokens of the text: warm-up and batch-1 prompts; requests come after


def build_workload(args, model_path: str) -> dict:
    """Token ids of real English text, cut into prompts at distinct offsets; fixed seed."""
    from pydoc_data.topics import topics

    from native_backend.config.cache_dir import tokenizer_cache_dir
    from native_backend.text.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(model_path, cache_dir=str(tokenizer_cache_dir()))
    ids = tok.encode("\n\n".join(topics.values()), add_special_tokens=False)
    rng = random.Random(args.seed)
    n = args.requests
    prompt_lens = [rng.randint(args.prompt_min, args.prompt_max) for _ in range(n)]
    output_lens = [rng.randint(args.output_min, args.output_max) for _ in range(n)]
    stride = (len(ids) - WARMUP_REGION - args.prompt_max) // n
    if stride < 1:
        raise SystemExit(f"text too short for {n} requests ({len(ids)} tokens)")
    # Non-overlapping windows when the text allows (no shared prefixes: the prefix cache stays cold).
    jitter = max(0, stride - args.prompt_max)
    offsets = [WARMUP_REGION + i * stride + rng.randint(0, jitter) for i in range(n)]
    prompts = [ids[o:o + length] for o, length in zip(offsets, prompt_lens)]
    b1_stride = 3 * args.b1_prompt // 2
    if args.b1_repeats * b1_stride + args.b1_prompt > WARMUP_REGION - 512:
        raise SystemExit("--b1-prompt x --b1-repeats too large for the reserved text region")
    workload = {
        "prompts": prompts,
        "output_lens": output_lens,
        "offsets": offsets,
        "warmup_prompts": [ids[WARMUP_REGION - 480:WARMUP_REGION - 432], ids[WARMUP_REGION - 400:WARMUP_REGION - 320]],
        "b1_prompts": [ids[r * b1_stride:r * b1_stride + args.b1_prompt] for r in range(args.b1_repeats)],
        "text_tokens": len(ids),
    }
    blob = json.dumps([prompts, output_lens, workload["b1_prompts"]]).encode()
    workload["sha256"] = hashlib.sha256(blob).hexdigest()[:16]
    return workload


def first_divergence(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def compare(ours: dict[int, list[int]], theirs: dict[int, list[int]]) -> dict:
    common = sorted(set(ours) & set(theirs))
    divergent = []
    for i in common:
        if ours[i] != theirs[i]:
            divergent.append({"request": i, "matching_prefix": first_divergence(ours[i], theirs[i]),
                              "length": len(theirs[i])})
    return {"compared": len(common), "identical": len(common) - len(divergent), "divergent": divergent}


def make_engine(spec):
    from native_backend.config.cache_dir import tokenizer_cache_dir
    from native_backend.config.engine import EngineConfig
    from native_backend.process.factory import make_engine_core

    started = time.perf_counter()
    engine = make_engine_core(EngineConfig.build(path=spec["model"], num_threads=spec["threads"],
                                          tokenizer_cache_dir=str(tokenizer_cache_dir()), **spec["engine_overrides"]))
    return engine, time.perf_counter() - started


def greedy(max_tokens: int):
    from native_backend.core.sampling_params import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def kvgate_run(engine, prompts: list[list[int]], output_lens: list[int], tag: str) -> dict:
    """Add every request at once, step until done; per-request tokens and token arrival times."""
    from native_backend.core.interface import EngineRequest

    ids = [f"{tag}{i}" for i in range(len(prompts))]
    tokens = {rid: [] for rid in ids}
    times = {rid: [] for rid in ids}
    finish = {}
    steps = 0
    start = time.perf_counter()
    for rid, prompt, n in zip(ids, prompts, output_lens):
        engine.add_request(EngineRequest(rid, list(prompt), greedy(n)))
    while engine.has_unfinished():
        outputs = engine.step()
        steps += 1
        now = time.perf_counter()
        for out in outputs:
            if out.new_token_ids:
                tokens[out.request_id].extend(out.new_token_ids)
                times[out.request_id].extend([now] * len(out.new_token_ids))
            if out.finished:
                finish[out.request_id] = out.finish_reason
    wall = time.perf_counter() - start
    return {"ids": ids, "tokens": tokens, "times": times, "finish": finish, "start": start, "wall": wall, "steps": steps}


def kvgate_warmup(engine, spec) -> None:
    kvgate_run(engine, spec["workload"]["warmup_prompts"], [8, 8], "warmup-")


def b1_numbers(start: float, times: list[float]) -> dict:
    n = len(times)
    return {
        "new_tokens": n,
        "ttft_s": times[0] - start,
        "decode_tok_s": (n - 1) / (times[-1] - times[0]) if n > 1 and times[-1] > times[0] else None,
        "total_tok_s": n / (times[-1] - start),
    }
