"""Structured outputs on the native engine (issue 28 items 5 and 6): validity, speed, compile times.

Model: SmolLM2-135M-Instruct (the default GGUF), CPU, `--threads` torch threads (default 2).

1. compile: every schema of bench/structured_battery.py (51) through the engine's compile service
   on SmolLM2's tokenizer: cold (first submit) and cached (the same schema again) milliseconds.
2. speed (in-process `LLMEngine`, one engine, one run): a C2-style batch (`--requests` requests,
   all added at once, the battery's prompts, max_tokens `--max-tokens`, seeded sampling at
   temperature 0.7) with every request constrained by its JSON schema, against the same batch
   unconstrained, each unconstrained request making exactly as many tokens as its constrained twin
   (EOS ignored: the same work, with and without masks), rounds interleaved (on, off, off, on,
   ...). Output tokens per second of wall time, median over `--rounds`; the ratio on/off is the
   median of each round's own ratio (its two batches back to back); how many outputs of each batch are complete and
   valid. Mask cost: time in the scheduler filling bitmasks and in the sampler applying them, per
   constrained row and step (timers wrapped around `Scheduler._fill_token_bitmasks` and
   `sampler.apply_token_bitmasks`), and the apply by itself on masks the run's grammars wrote
   (1, 16 and 64 rows of SmolLM2's 49,152 logits).
3. validity (`kvgate serve` in its own process, the openai client, 8 requests at a time): every
   battery schema, regex and choice with its constraint, and again without it (the same prompt,
   which shows the schema, so the model knows what is wanted): how many outputs are complete
   (finish_reason stop) and how many of those parse and validate (`jsonschema`, `re.fullmatch`).

    .venv/bin/python bench/structured.py                  # all three, writes bench/results/structured.json
    .venv/bin/python bench/structured.py --skip-validity  # compile and speed only (minutes)

A part skipped keeps its figures from the last run in the results file (each part records its args).
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
    """Time spent filling and applying bitmasks, and how many constrained row-steps had one; a
    context manager (the timers wrap the engine's functions inside the block only). It keeps the
    first `keep` masks it sees, for `apply_alone`."""

    def __init__(self, keep: int = 256):
        self.masks: list = []
        self._keep = keep
        self.reset()

    def reset(self) -> None:
        self.fill_s = self.apply_s = 0.0
        self.rows = 0
        self.calls: dict[str, list[float]] = {"fill": [], "apply": []}  # per step: seconds per constrained row

    def __enter__(self) -> "MaskTimer":
        from native_backend.core import scheduler as scheduler_module
        from native_backend.execution import sampler as sampler_module

        self._originals = (scheduler_module.Scheduler._fill_token_bitmasks, sampler_module.apply_token_bitmasks)
        fill, apply = self._originals

        def timed_fill(sched, plan):
            started = time.perf_counter()
            fill(sched, plan)
            took = time.perf_counter() - started
            rows = sum(1 for c in plan.chunks.values() if c.token_bitmask is not None)
            self.fill_s, self.rows = self.fill_s + took, self.rows + rows
            if rows:
                self.calls["fill"].append(took / rows)

        def timed_apply(logits, masks):
            self.masks.extend(m for m in masks[: self._keep - len(self.masks)] if m is not None)
            started = time.perf_counter()
            out = apply(logits, masks)
            if logits.is_cuda:
                torch_synchronize()
            took = time.perf_counter() - started
            self.apply_s += took
            rows = sum(m is not None for m in masks)
            if rows:
                self.calls["apply"].append(took / rows)
            return out

        scheduler_module.Scheduler._fill_token_bitmasks = timed_fill
        sampler_module.apply_token_bitmasks = timed_apply
        return self

    def __exit__(self, *exc) -> None:
        from native_backend.core import scheduler as scheduler_module
        from native_backend.execution import sampler as sampler_module

        scheduler_module.Scheduler._fill_token_bitmasks, sampler_module.apply_token_bitmasks = self._originals

    def per_row(self) -> dict:
        """Mean (all time / all rows) and the median step's cost per row: on a loaded machine one
        step descheduled for milliseconds moves the mean, not the median."""
        rows = max(self.rows, 1)
        medians = {f"mask_{k}_us_per_row_median": 1e6 * statistics.median(v) if v else 0.0 for k, v in self.calls.items()}
        return {"mask_fill_us_per_row": 1e6 * self.fill_s / rows, "mask_apply_us_per_row": 1e6 * self.apply_s / rows,
                **medians, "masked_row_steps": self.rows}


def torch_synchronize() -> None:
    import torch

    torch.cuda.synchronize()


def apply_alone(masks: list, vocab: int, device: str = "cpu", batches=(1, 16, 64), repeats: int = 20) -> dict:
    """The mask apply by itself, on masks the engine's grammars wrote during the run: batch ->
    microseconds per constrained row (median of `repeats`), every row constrained."""
    import torch

    from native_backend.execution.token_mask import apply_token_bitmasks

    out = {}
    for batch in batches:
        rows = [masks[i % len(masks)] for i in range(batch)]
        logits, times = torch.randn(batch, vocab, device=device), []
        for _ in range(repeats + 1):
            target = logits.clone()
            started = time.perf_counter()
            apply_token_bitmasks(target, rows)
            if target.is_cuda:
                torch_synchronize()
            times.append(time.perf_counter() - started)
        out[batch] = 1e6 * statistics.median(times[1:]) / batch
    return out


def one_batch(engine, requests: int, max_tokens: int, constrained: bool, seed: int, first: int = 0,
              lengths: list[int] | None = None) -> dict:
    """The C2-style batch (the battery's schemas from `first` on, in turn), all added at once,
    stepped to the end: output tok/s, how many outputs are complete (finish_reason stop) and how
    many of those validate against their schema, and each request's output length. With
    `lengths` (unconstrained only), request i makes exactly lengths[i] tokens (EOS ignored): the
    same work as its constrained twin, so that tok/s compares like with like (a constrained
    answer ends when its object is complete, usually sooner, and a batch's prefill is shared out
    over its output tokens)."""
    from native_backend.core.interface import EngineRequest
    from native_backend.core.sampling_params import SamplingParams
    from native_backend.text.grammar_spec import GrammarSpec

    batch, schemas = [], {}
    for i in range(requests):
        name, schema, request = SCHEMAS[(first + i) % len(SCHEMAS)]
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": ask(schema, request)}])
        grammar = GrammarSpec("json_schema", json.dumps(schema)) if constrained else None
        request_id = f"{'on' if constrained else 'off'}-{seed}-{i}"
        schemas[request_id] = schema
        sampling = SamplingParams(max_tokens=max_tokens, temperature=0.7, seed=seed + i) if lengths is None else \
            SamplingParams(max_tokens=lengths[i], temperature=0.7, seed=seed + i, ignore_eos=True)
        batch.append(EngineRequest(request_id, prompt, sampling, grammar=grammar))
    made, texts, reasons, started = dict.fromkeys(schemas, 0), dict.fromkeys(schemas, ""), {}, time.perf_counter()
    for request in batch:
        engine.add_request(request)
    while engine.has_unfinished():
        for out in engine.step():
            made[out.request_id] += len(out.new_token_ids)
            texts[out.request_id] += out.new_text
            if out.finished:
                reasons[out.request_id] = out.finish_reason
    wall, tokens = time.perf_counter() - started, sum(made.values())
    complete = [rid for rid, reason in reasons.items() if reason == "stop"]
    return {"output_tokens": tokens, "wall_s": wall, "tok_s": tokens / wall, "complete": len(complete),
            "complete_valid": sum(valid_json(texts[rid], schemas[rid]) for rid in complete),
            "lengths": list(made.values())}


def matched_batches(engine, requests: int, max_tokens: int, seed: int, first: int = 0,
                    lengths: list[int] | None = None) -> dict:
    """The constrained batch and its unconstrained twin (each request as many tokens as its
    constrained self). Given the constrained lengths of this seed (a round before ran it), the
    twin runs first; otherwise the constrained batch does."""
    if lengths is None:
        on = one_batch(engine, requests, max_tokens, True, seed, first)
        return {"on": on, "off": one_batch(engine, requests, max_tokens, False, seed, first, on["lengths"])}
    off = one_batch(engine, requests, max_tokens, False, seed, first, lengths)
    return {"off": off, "on": one_batch(engine, requests, max_tokens, True, seed, first)}


def valid_json(text: str, schema: dict) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), schema, format_checker=jsonschema.FormatChecker())
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def speed(engine, args) -> dict:
    from native_backend.text.grammar_spec import GrammarSpec

    for name, schema, _ in SCHEMAS[: args.requests]:  # compile outside the timed rounds
        engine.core._grammar_service().submit(GrammarSpec("json_schema", json.dumps(schema))).result()
    with MaskTimer() as timer:
        # Warm-up at the measured batch's size, both ways: the first batch of a size pays for cold
        # allocations and kernel paths (a 4-request warm-up left round 0 at half speed).
        matched_batches(engine, args.requests, args.max_tokens, seed=999)
        timer.reset()
        rounds, lengths = {"off": [], "on": []}, {}
        for r in range(args.rounds):  # rounds 2k and 2k + 1 share a seed: constrained first, then second
            seed = 100 * (r // 2)
            pair = matched_batches(engine, args.requests, args.max_tokens, seed, lengths=lengths.get(seed))
            lengths[seed] = pair["on"]["lengths"]
            for mode in pair:
                rounds[mode].append(pair[mode])
                print(f"  round {r} {mode}: {pair[mode]}", flush=True)
    off = statistics.median(x["tok_s"] for x in rounds["off"])
    on = statistics.median(x["tok_s"] for x in rounds["on"])
    # Each round's two batches ran back to back: their ratio sees the same load, the medians of
    # the two columns may not (a shared box's load drifts between rounds).
    paired = [a["tok_s"] / b["tok_s"] for a, b in zip(rounds["on"], rounds["off"])]
    return {"requests": args.requests, "max_tokens": args.max_tokens, "rounds": rounds,
            "unconstrained_tok_s": off, "constrained_tok_s": on, "ratio_of_medians": on / off,
            "round_ratios": paired, "ratio": statistics.median(paired), **timer.per_row(),
            "apply_alone_us_per_row": apply_alone(timer.masks, engine.core.model_config.vocab_size)}


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
        valid = valid_json(text, case["schema"])
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
    # A part skipped keeps its figures from the last run that measured it (each part says its args).
    out = Path(args.out)
    result = json.loads(out.read_text()) if out.exists() else {}
    for part in ("compile", "speed", "validity"):  # a file of the days of one args for all parts
        if part in result and "args" in result:
            result[part].setdefault("args", result["args"])
    result.pop("args", None)
    if not args.skip_speed:
        from native_backend.config.engine import EngineConfig
        from native_backend.model.loader import default_gguf_path
        from native_backend.process.factory import make_engine_core

        engine = make_engine_core(EngineConfig.build(path=default_gguf_path(), num_threads=args.threads,
                                                     max_num_seqs=args.requests, max_num_batched_tokens=512))
        result["compile"] = {"args": vars(args), **compile_times(engine)}
        print("compile:", json.dumps(result["compile"]), flush=True)
        result["speed"] = {"args": vars(args), **speed(engine, args)}
        print("speed:", json.dumps({k: v for k, v in result["speed"].items() if k not in ("rounds", "args")}), flush=True)
        out.write_text(json.dumps(result, indent=1) + "\n")  # kept should validity not finish
        del engine
    if not args.skip_validity:
        result["validity"] = {"args": vars(args), **validity(args)}
        out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
