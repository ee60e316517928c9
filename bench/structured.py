"""Structured outputs on the native engine (issue 28 items 5 and 6): validity, speed, compile times.

Model: SmolLM2-135M-Instruct (the default GGUF), CPU, `--threads` torch threads (default 2).

1. compile: every schema of bench/structured_battery.py (51) through the engine's compile service
   on SmolLM2's tokenizer: cold (first submit) and cached (the same schema again) milliseconds.
2. speed (in-process `LLMEngine`, one engine, one run): a C2-style batch (`--requests` requests,
   all added at once, the battery's prompts, max_tokens `--max-tokens`, seeded sampling at
   temperature 0.7) with every request constrained by its JSON schema, against the same batch
   unconstrained, rounds interleaved (off, on, off, on, ...). Output tokens per second of wall
   time, median over `--rounds`; the ratio on/off. Mask cost: time in the scheduler filling
   bitmasks and in the sampler applying them, per constrained row and step (timers wrapped around
   `Scheduler._fill_token_bitmasks` and `sampler.apply_token_bitmasks`). The two batches do not make
   the same number of tokens (a constrained request ends when its object is complete); tok/s is
   per token made.
3. validity (`kvgate serve` in its own process, the openai client, 8 requests at a time): every
   battery schema, regex and choice with its constraint, and again without it (the same prompt,
   which shows the schema, so the model knows what is wanted): how many outputs are complete
   (finish_reason stop) and how many of those parse and validate (`jsonschema`, `re.fullmatch`).

    .venv/bin/python bench/structured.py                  # all three, writes bench/results/structured.json
    .venv/bin/python bench/structured.py --skip-validity  # compile and speed only (minutes)
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from structured_battery import CHOICES, REGEXES, SCHEMAS  # noqa: E402

SERVE_CONFIG = """
models:
  - name: smollm2
    deployments:
      - name: native-0
        backend: native
        settings: {{max_num_seqs: 8, max_num_batched_tokens: 256, kv_cache_bytes: 268435456, num_threads: {threads}}}
"""


def ask(schema: dict, request: str) -> str:
    return f"{request} Answer with JSON only, matching this JSON schema: {json.dumps(schema)}"


# ------------------------------------------------------------------------------ 1. compile


def compile_times(engine) -> dict:
    from native_backend.text.grammar_spec import GrammarSpec

    service = engine.core._grammar_service()
    service.submit(GrammarSpec("regex", "warm-up")).result()  # the compiler itself (tokenizer trie)
    cold, cached, refused = [], [], []
    for name, schema, _ in SCHEMAS:
        spec = GrammarSpec("json_schema", json.dumps(schema))
        for times in (cold, cached):
            started = time.perf_counter()
            try:
                service.submit(spec).result()
            except ValueError as exc:
                refused.append(f"{name}: {exc}")
                break
            times.append(1e3 * (time.perf_counter() - started))
    return {"schemas": len(SCHEMAS), "refused": refused, "cold_ms_median": statistics.median(cold),
            "cold_ms_max": max(cold), "cold_ms_total": sum(cold), "cached_ms_median": statistics.median(cached),
            "cached_ms_max": max(cached)}


# ------------------------------------------------------------------------------ 2. speed


class MaskTimer:
    """Time spent filling and applying bitmasks, and how many constrained row-steps had one."""

    def __init__(self):
        from native_backend.core import scheduler as scheduler_module
        from native_backend.execution import sampler as sampler_module

        self.fill_s = self.apply_s = 0.0
        self.rows = 0
        fill, apply = scheduler_module.Scheduler._fill_token_bitmasks, sampler_module.apply_token_bitmasks

        def timed_fill(sched, plan):
            started = time.perf_counter()
            fill(sched, plan)
            self.fill_s += time.perf_counter() - started
            self.rows += sum(1 for c in plan.chunks.values() if c.token_bitmask is not None)

        def timed_apply(logits, masks):
            started = time.perf_counter()
            out = apply(logits, masks)
            self.apply_s += time.perf_counter() - started
            return out

        scheduler_module.Scheduler._fill_token_bitmasks = timed_fill
        sampler_module.apply_token_bitmasks = timed_apply


def one_batch(engine, requests: int, max_tokens: int, constrained: bool, seed: int) -> dict:
    from native_backend.core.interface import EngineRequest
    from native_backend.core.sampling_params import SamplingParams
    from native_backend.text.grammar_spec import GrammarSpec

    batch = []
    for i in range(requests):
        name, schema, request = SCHEMAS[i % len(SCHEMAS)]
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": ask(schema, request)}])
        grammar = GrammarSpec("json_schema", json.dumps(schema)) if constrained else None
        batch.append(EngineRequest(f"{'on' if constrained else 'off'}-{seed}-{i}", prompt,
                                   SamplingParams(max_tokens=max_tokens, temperature=0.7, seed=seed + i),
                                   grammar=grammar))
    tokens, started = 0, time.perf_counter()
    for request in batch:
        engine.add_request(request)
    while engine.has_unfinished():
        tokens += sum(len(out.new_token_ids) for out in engine.step())
    wall = time.perf_counter() - started
    return {"output_tokens": tokens, "wall_s": wall, "tok_s": tokens / wall}


def speed(engine, args) -> dict:
    timer = MaskTimer()
    for name, schema, _ in SCHEMAS[: args.requests]:  # compile outside the timed rounds
        from native_backend.text.grammar_spec import GrammarSpec

        engine.core._grammar_service().submit(GrammarSpec("json_schema", json.dumps(schema))).result()
    one_batch(engine, 4, 8, True, seed=999)  # warm-up
    timer.fill_s = timer.apply_s = 0.0
    timer.rows = 0
    rounds = {"off": [], "on": []}
    for r in range(args.rounds):
        for mode in ("off", "on") if r % 2 == 0 else ("on", "off"):
            rounds[mode].append(one_batch(engine, args.requests, args.max_tokens, mode == "on", seed=100 * r))
            print(f"  round {r} {mode}: {rounds[mode][-1]}", flush=True)
    off = statistics.median(x["tok_s"] for x in rounds["off"])
    on = statistics.median(x["tok_s"] for x in rounds["on"])
    return {"requests": args.requests, "max_tokens": args.max_tokens, "rounds": rounds,
            "unconstrained_tok_s": off, "constrained_tok_s": on, "ratio": on / off,
            "mask_fill_us_per_row": 1e6 * timer.fill_s / max(timer.rows, 1),
            "mask_apply_us_per_row": 1e6 * timer.apply_s / max(timer.rows, 1), "masked_row_steps": timer.rows}


# ------------------------------------------------------------------------------ 3. validity


def battery_cases(limit: int | None = None) -> list[dict]:
    """The battery's cases; with `limit`, that many spread over the levels (every k-th schema)
    and every regex and choice."""
    schemas = SCHEMAS if limit is None else SCHEMAS[:: max(1, len(SCHEMAS) // limit)][:limit]
    cases = [{"kind": "json_schema", "name": n, "schema": s, "prompt": ask(s, r)} for n, s, r in schemas]
    cases += [{"kind": "regex", "name": n, "regex": p, "prompt": f"{r} Answer with text matching the regex {p} only."}
              for n, p, r in REGEXES]
    cases += [{"kind": "choice", "name": n, "choice": c, "prompt": f"{r} Answer with one of: {', '.join(c)}."}
              for n, c, r in CHOICES]
    return cases


def run_case(client, case: dict, constrained: bool, seed: int) -> dict:
    import jsonschema

    kw = dict(model="smollm2", messages=[{"role": "user", "content": case["prompt"]}], max_tokens=96,
              temperature=0.7, seed=seed)
    if constrained and case["kind"] == "json_schema":
        kw["response_format"] = {"type": "json_schema", "json_schema": {"name": case["name"], "schema": case["schema"]}}
    elif constrained:
        kw["extra_body"] = {"structured_outputs": {case["kind"]: case[case["kind"]]}}
    try:
        out = client.chat.completions.create(**kw)
    except Exception as exc:  # noqa: BLE001 - a refusal is a result too
        return {"name": case["name"], "status": "error", "error": f"{type(exc).__name__}: {exc}"[:300]}
    choice = out.choices[0]
    text = choice.message.content or ""
    if case["kind"] == "json_schema":
        try:
            jsonschema.validate(json.loads(text), case["schema"], format_checker=jsonschema.FormatChecker())
            valid = True
        except (ValueError, jsonschema.ValidationError):
            valid = False
    elif case["kind"] == "regex":
        valid = re.fullmatch(case["regex"], text) is not None
    else:
        valid = text in case["choice"]
    return {"name": case["name"], "kind": case["kind"], "status": choice.finish_reason, "valid": valid,
            "tokens": out.usage.completion_tokens, "text": text[:200]}


def validity(args) -> dict:
    import openai
    from tests.support.servers.loopback import free_port
    from upstream_overhead import spawn

    port = free_port()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "structured.yaml"
        config.write_text(SERVE_CONFIG.format(threads=args.threads))
        base = f"http://127.0.0.1:{port}"
        server = spawn([sys.executable, "-m", "gateway.cli", "serve", "--config", str(config), "--port", str(port)],
                       base + "/health/ready", env={"PYTHONPATH": str(ROOT)}, timeout=900)
        try:
            client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=900)
            cases = battery_cases(args.schemas)
            with concurrent.futures.ThreadPoolExecutor(8) as pool:
                for mode in ("constrained", "unconstrained"):
                    futures = [pool.submit(run_case, client, c, mode == "constrained", i) for i, c in enumerate(cases)]
                    results[mode] = [f.result() for f in futures]
                    print(f"  {mode}: {summary(results[mode])}", flush=True)
        finally:
            server.terminate()
            server.wait(60)
    return {mode: {"summary": summary(rows), "cases": rows} for mode, rows in results.items()}


def summary(rows: list[dict]) -> dict:
    complete = [r for r in rows if r["status"] == "stop"]
    return {"cases": len(rows), "complete": len(complete), "complete_valid": sum(r["valid"] for r in complete),
            "cut_by_max_tokens": sum(r["status"] == "length" for r in rows),
            "errors": sum(r["status"] == "error" for r in rows), "valid_any": sum(r.get("valid", False) for r in rows)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--schemas", type=int, default=None, help="validity: this many of the schemas (all)")
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--skip-validity", action="store_true")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "structured.json"))
    args = parser.parse_args()
    result = {"args": vars(args)}
    if not args.skip_speed:
        from native_backend.config.engine import EngineConfig
        from native_backend.model.loader import default_gguf_path
        from native_backend.process.factory import make_engine_core

        engine = make_engine_core(EngineConfig.build(path=default_gguf_path(), num_threads=args.threads,
                                                     max_num_seqs=args.requests, max_num_batched_tokens=512))
        result["compile"] = compile_times(engine)
        print("compile:", json.dumps(result["compile"]), flush=True)
        result["speed"] = speed(engine, args)
        print("speed:", json.dumps({k: v for k, v in result["speed"].items() if k != "rounds"}), flush=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")  # kept should validity not finish
        del engine
    if not args.skip_validity:
        result["validity"] = validity(args)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
