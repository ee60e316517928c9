"""Speculative decoding: output tokens/s with and without it, at batch 1 and under load, one run.

Model: SmolLM2-135M-Instruct (the default GGUF, fp32), CPU, `--threads` torch threads (2).
Every configuration is a fresh engine in this process, warmed up (untimed) before it is timed;
greedy, so every configuration emits the same tokens (checked: a mismatch is reported) and the
ratios compare equal work.

- batch 1: each prompt alone, `--b1-new` new tokens (EOS ends it early; the same place in every
  configuration). Two sets of chat prompts built with the model's chat template: copy-heavy
  (rewrite / continue / edit a given passage, code edits: the answer repeats the prompt) and
  ordinary chat questions. Decode rate = (tokens - 1) / (last token time - first token time):
  prefill excluded. Per set: the rate summed over prompts (total tokens / total decode time),
  speed-up against no speculation, acceptance rate (accepted / proposed drafts) and mean
  accepted length (tokens emitted per verification, the target's own token included).
- C2 (under load): `bench/engine_throughput.py`'s workload (64 requests, prompts 64-512 tokens of
  pydoc text, outputs 64-256, all added at t=0, max_num_seqs 64): output tok/s of the whole run.

- batch sweep (`--sweep`): B requests at once (copy-heavy and chat prompts in turn, 96 new
  tokens, decode rate once all have their first token) for B in 1, 4, 8, 16, 32, n-gram with the load policy disabled (max_batch_size null)
  against no speculation: where speculation stops paying, which sets the policy's default.

Configurations: off; ngram (k = --k); draft = the target's first --draft-layers layers
(self-speculative); draft = a second copy of the target (acceptance 1.0 by construction: an
upper bound on acceptance, never a speed-up, as the only model shipped is the target itself);
with --int4-draft DIR, draft = an AWQ int4 copy of the target (`kvgate quantize`); with
--reserve-k, ngram-reserve-k = n-gram whose scheduler reserves k draft slots (budget and blocks)
for every decoding request, match or not (the policy without the proposer's count: the "before"
of slots-only-for-drafts, side by side).
"tok/s" is OUTPUT tokens per second.

The box is shared, so every comparison is interleaved: all engines are built first, then
--rounds rounds run each configuration in turn (A B C A B C; C2: off, ngram, off, ngram). A row
gives the median tok/s over the rounds, the median of its per-round ratios to "off", the same
ratio in output tokens per CPU second of this process (time.process_time: with one torch thread
the work done, much less sensitive to the other jobs on a shared box), and the load average.

    .venv/bin/python bench/spec_decode.py                 # everything (about 30 minutes on 2 cores)
    .venv/bin/python bench/spec_decode.py --quick         # fewer prompts and a smaller C2
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.engine_runs import build_workload  # noqa: E402

PASSAGE_TOPICS = ("assert", "break", "continue", "for", "if", "return")


def copy_heavy_prompts() -> list[list[dict]]:
    """Chat turns whose answers repeat what the prompt holds (the n-gram proposer's case)."""
    import json as json_module
    import textwrap as textwrap_module
    from pydoc_data.topics import topics

    passages = [" ".join(topics[name].split())[:700] for name in PASSAGE_TOPICS]
    code = [inspect.getsource(f) for f in (json_module.dumps, textwrap_module.dedent)]
    asks = [
        "Rewrite the following passage, fixing any typos and keeping everything else the same:\n\n{}",
        "Repeat the following text exactly, then add one sentence that summarises it:\n\n{}",
        "Continue the following documentation in the same style, starting by restating it:\n\n{}",
        "Copy this passage and put every sentence on its own line:\n\n{}",
    ]
    turns = [[{"role": "user", "content": ask.format(p)}] for ask, p in zip(asks * 2, passages)]
    turns += [[{"role": "user", "content": f"Rename the variable `obj` to `value` in this code and return the whole "
                                           f"function:\n\n```python\n{c[:1500]}\n```"}] for c in code]
    return turns


CHAT_QUESTIONS = [
    "What is the capital of France, and why is it famous?",
    "Give me three tips for sleeping better.",
    "Explain what a hash table is to a beginner.",
    "Write a short poem about the sea.",
    "How do plants make food from sunlight?",
    "What should I pack for a weekend hiking trip?",
    "Why is the sky blue?",
    "Suggest a name for a small coffee shop and explain it.",
]


def configurations(args) -> dict[str, dict | None]:
    from native_backend.model.loader import default_gguf_path

    k = args.k
    return {
        "off": None,
        "ngram": dict(method="ngram", num_speculative_tokens=k),
        f"draft-self{args.draft_layers}": dict(method="draft", draft_num_layers=args.draft_layers,
                                               num_speculative_tokens=min(k, 2)),
        "draft-copy": dict(method="draft", draft_model=default_gguf_path(), num_speculative_tokens=min(k, 2)),
        **({"draft-int4": dict(method="draft", draft_model=args.int4_draft, num_speculative_tokens=min(k, 2))}
           if args.int4_draft else {}),
        **({RESERVE_K: dict(method="ngram", num_speculative_tokens=k)} if args.reserve_k else {}),
    }


RESERVE_K = "ngram-reserve-k"


def build(args, name: str, speculative, **overrides):
    """The configuration's engine; ngram-reserve-k's policy does not ask the proposer's count."""
    engine = make_engine(args, speculative, **overrides)
    if name == RESERVE_K:
        engine.core.scheduler.speculation.count_drafts = None
    return engine


def make_engine(args, speculative, **overrides):
    from native_backend.config.cache_dir import tokenizer_cache_dir
    from native_backend.config.engine import EngineConfig
    from native_backend.model.loader import default_gguf_path
    from native_backend.process.factory import make_engine_core

    return make_engine_core(EngineConfig.build(path=default_gguf_path(), num_threads=args.threads,
                                        tokenizer_cache_dir=str(tokenizer_cache_dir()), speculative=speculative,
                                        **overrides))


def run(engine, prompts: list[list[int]], max_tokens: list[int], ignore_eos: bool, tag: str) -> dict:
    """All prompts at once, step until done: tokens, token times, and the speculation counters."""
    from native_backend.core.interface import EngineRequest
    from native_backend.core.sampling_params import SamplingParams

    before = dataclasses.asdict(engine.stats())
    ids = [f"{tag}{i}" for i in range(len(prompts))]
    tokens = {rid: [] for rid in ids}
    times = {rid: [] for rid in ids}
    start, cpu_start = time.perf_counter(), time.process_time()
    for rid, prompt, n in zip(ids, prompts, max_tokens):
        engine.add_request(EngineRequest(rid, list(prompt), SamplingParams(max_tokens=n, temperature=0.0,
                                                                           ignore_eos=ignore_eos)))
    while engine.has_unfinished():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            tokens[out.request_id] += out.new_token_ids
            times[out.request_id] += [now] * len(out.new_token_ids)
    after = dataclasses.asdict(engine.stats())
    spec = {k: after[k] - before[k] for k in ("spec_decode_num_drafts", "spec_decode_num_draft_tokens",
                                              "spec_decode_num_accepted_tokens")}
    return {"tokens": [tokens[r] for r in ids], "times": [times[r] for r in ids],
            "wall": time.perf_counter() - start, "cpu": time.process_time() - cpu_start, "spec": spec}


def spec_summary(spec: dict) -> dict:
    drafts, proposed, accepted = (spec["spec_decode_num_drafts"], spec["spec_decode_num_draft_tokens"],
                                  spec["spec_decode_num_accepted_tokens"])
    return {"acceptance_rate": accepted / proposed if proposed else None,
            "mean_accepted_length": 1 + accepted / drafts if drafts else None, "num_drafts": drafts}


def batch1(args, engine, prompt_sets: dict[str, list[list[int]]]) -> dict:
    engine_result = {}
    for name, prompts in prompt_sets.items():
        spec_total = dict.fromkeys(("spec_decode_num_drafts", "spec_decode_num_draft_tokens",
                                    "spec_decode_num_accepted_tokens"), 0)
        tokens, decode_tokens, decode_s, cpu_s = [], 0, 0.0, 0.0
        for i, prompt in enumerate(prompts):
            r = run(engine, [prompt], [args.b1_new], False, f"{name}{i}-")
            times = r["times"][0]
            tokens.append(r["tokens"][0])
            decode_tokens += len(times) - 1
            decode_s += times[-1] - times[0]
            cpu_s += r["cpu"]
            for key in spec_total:
                spec_total[key] += r["spec"][key]
        engine_result[name] = {"decode_tok_s": decode_tokens / decode_s, "tokens": tokens,
                               "cpu_tok_s": sum(map(len, tokens)) / cpu_s, **spec_summary(spec_total)}
    return engine_result


def c2(args, engine, workload: dict) -> dict:
    r = run(engine, workload["prompts"], workload["output_lens"], True, "c2-")
    out = sum(map(len, r["tokens"]))
    return {"out_tok_s": out / r["wall"], "wall_s": r["wall"], "cpu_tok_s": out / r["cpu"], "tokens": r["tokens"],
            **spec_summary(r["spec"])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens (the draft methods use min(k, 2))")
    p.add_argument("--draft-layers", type=int, default=24)
    p.add_argument("--int4-draft", help="an AWQ int4 copy of the target (kvgate quantize): adds a draft-int4 row")
    p.add_argument("--b1-new", type=int, default=128)
    p.add_argument("--requests", type=int, default=64, help="C2 requests")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds (A B A B ...): medians over them")
    p.add_argument("--reserve-k", action="store_true", help="adds ngram-reserve-k: k slots whatever the proposer has")
    p.add_argument("--only", nargs="*", help="configurations to run (default: all)")
    p.add_argument("--skip-c2", action="store_true")
    p.add_argument("--only-c2", action="store_true", help="only the C2 pair (off, ngram with the policy)")
    p.add_argument("--sweep", action="store_true", help="only the batch-size sweep")
    p.add_argument("--sweep-new", type=int, default=96, help="new tokens per request in the sweep")
    p.add_argument("--quick", action="store_true", help="4 prompts per set, 16 C2 requests")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "spec_decode.json"))
    args = p.parse_args()
    if args.quick:
        args.requests = 16
    from native_backend.model.loader import default_gguf_path

    workload = build_workload(argparse.Namespace(seed=0, requests=args.requests, prompt_min=64, prompt_max=512,
                                                 output_min=64, output_max=256, b1_prompt=128, b1_repeats=1),
                              default_gguf_path())
    if args.sweep:
        report = {"args": vars(args), "sweep": sweep(args)}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out.replace(".json", "_sweep.json")).write_text(json.dumps(report, indent=1))
        return
    configs = {name: spec for name, spec in configurations(args).items() if not args.only or name in args.only}
    results = {}
    if not args.only_c2:
        results["batch1"] = interleaved_batch1(args, configs, workload)
    if not args.skip_c2:
        results["c2"] = interleaved_c2(args, configs, workload)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    report = summarize(args, results)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print_table(report)


def timed(fn, *a):
    """fn(*a) with the load average before and after (the box is shared: say how busy it was)."""
    load_before = os.getloadavg()[0]
    result = fn(*a)
    return {**result, "load_avg": (load_before + os.getloadavg()[0]) / 2}


def interleaved_batch1(args, configs: dict, workload: dict) -> dict[str, list[dict]]:
    """Every configuration's engine built first, then `rounds` rounds of each in turn (A B C A B C):
    whatever else loads the box falls on all of them alike."""
    engines = {name: build(args, name, spec, max_num_seqs=4, kv_cache_bytes=128 << 20)
               for name, spec in configs.items()}
    tok = next(iter(engines.values())).tokenizer
    prompt_sets = {"copy-heavy": [tok.apply_chat_template(t) for t in copy_heavy_prompts()],
                   "chat": [tok.apply_chat_template([{"role": "user", "content": q}]) for q in CHAT_QUESTIONS]}
    if args.quick:
        prompt_sets = {k: v[:4] for k, v in prompt_sets.items()}
    return warm_then_rounds(args, engines, workload, "batch 1", batch1, prompt_sets)


def interleaved_c2(args, configs: dict, workload: dict) -> dict[str, list[dict]]:
    """C2 with speculation off and on (n-gram, the load policy at its defaults): A B A B."""
    names = [n for n in ("off", "ngram", RESERVE_K) if n in configs]
    engines = {n: build(args, n, configs[n], max_num_seqs=64) for n in names}
    return warm_then_rounds(args, engines, workload, "C2", c2, workload)


def warm_then_rounds(args, engines: dict, workload: dict, label: str, measure, measured_on) -> dict[str, list[dict]]:
    """Warm every engine up (untimed), then `args.rounds` rounds of `measure` on each in turn."""
    for engine in engines.values():
        run(engine, workload["warmup_prompts"], [8, 8], True, "warmup-")
    rounds = {name: [] for name in engines}
    for i in range(args.rounds):
        for name, engine in engines.items():
            print(f"[{label}, round {i + 1}] {name} ...", file=sys.stderr, flush=True)
            rounds[name].append(timed(measure, args, engine, measured_on))
    return rounds


def sweep(args) -> list[dict]:
    rows, engines = [], {}
    for name, speculative in (("off", None), ("ngram", dict(method="ngram", num_speculative_tokens=args.k,
                                                            max_batch_size=None))):
        engines[name] = make_engine(args, speculative, max_num_seqs=64)
        run(engines[name], [[1, 2, 3, 4] * 8], [8], True, "warmup-")
    tok = engines["off"].tokenizer
    pool = [tok.apply_chat_template(t) for t in copy_heavy_prompts()]
    pool = [p for pair in zip(pool, [tok.apply_chat_template([{"role": "user", "content": q}])
                                     for q in CHAT_QUESTIONS]) for p in pair]
    for b in (1, 4, 8, 16, 32):
        prompts = [pool[i % len(pool)] for i in range(b)]
        rates = {}
        for name, engine in engines.items():
            r = run(engine, prompts, [args.sweep_new] * b, True, f"sweep{b}-")
            rates[name] = decode_rate(r)
            if name == "ngram":
                rates.update(spec_summary(r["spec"]))
        row = {"batch": b, "off_tok_s": rates["off"], "ngram_tok_s": rates["ngram"],
               "speedup": rates["ngram"] / rates["off"], "acceptance_rate": rates["acceptance_rate"]}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def decode_rate(r: dict) -> float:
    """Output tokens/s once every request has its first token (prefill excluded)."""
    all_started = max(t[0] for t in r["times"])
    end = max(t[-1] for t in r["times"])
    later = sum(1 for t in r["times"] for x in t if x > all_started)
    return later / (end - all_started)


def summarize(args, results: dict) -> dict:
    """Medians over the interleaved rounds; a configuration's speed-up is the median of its
    round-by-round ratios to "off" (each ratio from neighbouring runs)."""
    rows = []
    b1 = results.get("batch1", {})
    base = b1.get("off")
    for name, rounds in b1.items():
        for set_name in (k for k in rounds[0] if k != "load_avg"):
            rates = [r[set_name]["decode_tok_s"] for r in rounds]
            ratios = [r[set_name]["decode_tok_s"] / o[set_name]["decode_tok_s"] for r, o in zip(rounds, base)] if base else []
            cpu = [r[set_name]["cpu_tok_s"] / o[set_name]["cpu_tok_s"] for r, o in zip(rounds, base)] if base else []
            rows.append(_row(name, f"batch 1, {set_name}", rates, ratios, cpu, rounds[0][set_name],
                             [r["load_avg"] for r in rounds],
                             base is not None and all(r[set_name]["tokens"] == base[0][set_name]["tokens"] for r in rounds)))
    c2_rounds = results.get("c2", {})
    base = c2_rounds.get("off")
    for name, rounds in c2_rounds.items():
        rates = [r["out_tok_s"] for r in rounds]
        ratios = [r["out_tok_s"] / o["out_tok_s"] for r, o in zip(rounds, base)] if base else []
        cpu = [r["cpu_tok_s"] / o["cpu_tok_s"] for r, o in zip(rounds, base)] if base else []
        rows.append(_row(name, f"C2 ({args.requests} requests, max_num_seqs 64)", rates, ratios, cpu, rounds[-1],
                         [r["load_avg"] for r in rounds],
                         base is not None and all(r["tokens"] == base[0]["tokens"] for r in rounds)))
    return {"args": vars(args), "rows": rows,
            "method": f"{args.rounds} interleaved rounds (A B A B): median tok/s, median of per-round ratios to off; "
                      "cpu_speedup: the same ratio of output tokens per CPU second of this process (time.process_time, "
                      "one torch thread: the work done, less sensitive to other jobs on the box)"}


def _row(config, workload, rates, ratios, cpu_ratios, spec_of, loads, same) -> dict:
    return {"config": config, "workload": workload, "tok_s": statistics.median(rates), "tok_s_rounds": rates,
            "speedup": statistics.median(ratios) if ratios else None, "speedup_rounds": ratios,
            "cpu_speedup": statistics.median(cpu_ratios) if cpu_ratios else None, "cpu_speedup_rounds": cpu_ratios,
            "acceptance_rate": spec_of["acceptance_rate"], "mean_accepted_length": spec_of["mean_accepted_length"],
            "load_avg": statistics.mean(loads), "same_tokens": same}


def print_table(report: dict) -> None:
    def f(x, spec=".2f"):
        return "-" if x is None else format(x, spec)

    print(f"{'config':<16} {'workload':<36} {'out tok/s':>9} {'vs off':>7} {'cpu vs':>7} {'accept':>7} "
          f"{'mean len':>8} {'load':>5} same")
    for r in report["rows"]:
        print(f"{r['config']:<16} {r['workload']:<36} {f(r['tok_s'], '.1f'):>9} {f(r['speedup']):>7} "
              f"{f(r['cpu_speedup']):>7} {f(r['acceptance_rate']):>7} {f(r['mean_accepted_length']):>8} {f(r['load_avg'], '.1f'):>5} "
              f"{'yes' if r['same_tokens'] else 'NO'}")


if __name__ == "__main__":
    main()
