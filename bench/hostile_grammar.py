"""A normal stream's gaps on the native engine while other requests send a hostile regex (issue 40
item 3): `^((c{100}){100}){100}$`, a new letter c each time so no compile is a cache hit.

Three modes, interleaved round by round on one engine configuration (SmolLM2 GGUF, 1 thread):
  quiet   the stream alone
  after   hostile requests every --interval-s seconds, this tree's grammar service (the lexer built
          in the compile worker under the fuel limits)
  before  the same load with the old behaviour put back in this process: llguidance's default
          fuel (1M / 200k) and no warm-up, so the first mask builds the lexer on the step loop

Each mode runs a greedy stream of --tokens tokens (ignore_eos) and records the time between its
tokens as the engine loop hands them out; hostile requests are counted by how they ended (a 400:
invalid; a 500: internal). Prints one JSON object; --out writes it too.

    .venv/bin/python bench/hostile_grammar.py --rounds 2 --tokens 64 --interval-s 0.5
"""

from __future__ import annotations

import argparse
import json
import os
import string
import tempfile
import time

import numpy as np

from native_backend.config.engine import EngineConfig
from native_backend.core.interface import EngineRequest
from native_backend.core.sampling_params import SamplingParams
from native_backend.model.loader import default_gguf_path
from native_backend.process.factory import make_engine_core
from native_backend.text import grammar as grammar_module
from native_backend.text.grammar_spec import GrammarSpec

OLD_LIMITS = dict(step_lexer_fuel=200_000, step_max_items=50_000, initial_lexer_fuel=1_000_000,
                  max_grammar_size=500_000)


def make_engine(cache_dir: str):
    config = EngineConfig.build(path=default_gguf_path(), tokenizer_cache_dir=cache_dir, num_threads=1,
                                quantization="gguf", max_num_seqs=8, max_num_batched_tokens=256)
    return make_engine_core(config)


def run_mode(mode: str, args, cache_dir: str) -> dict:
    saved_limits, saved_warm = dict(grammar_module.PARSER_LIMITS), grammar_module.Grammar.warm
    if mode == "before":
        grammar_module.PARSER_LIMITS.update(OLD_LIMITS)
        grammar_module.Grammar.warm = lambda self: None
    try:
        return _measure(make_engine(cache_dir), mode, args)
    finally:
        grammar_module.PARSER_LIMITS.clear()
        grammar_module.PARSER_LIMITS.update(saved_limits)
        grammar_module.Grammar.warm = saved_warm


def _measure(engine, mode: str, args) -> dict:
    ask = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Tell me a long story."}])
    warm = EngineRequest("warm", ask, SamplingParams(max_tokens=4, temperature=0.0))
    engine.add_request(warm)
    while engine.has_unfinished():
        engine.step()
    engine.add_request(EngineRequest("stream", ask, SamplingParams(max_tokens=args.tokens, temperature=0.0,
                                                                   ignore_eos=True)))
    stamps, ended, letters, next_hostile = [], {}, iter(string.ascii_lowercase * 4), time.monotonic()
    while engine.has_unfinished():
        now = time.monotonic()
        if mode != "quiet" and now >= next_hostile and len(stamps) < args.tokens:
            letter = next(letters)
            engine.add_request(EngineRequest(f"hostile-{letter}-{len(ended)}-{now}", ask,
                                             SamplingParams(max_tokens=8),
                                             grammar=GrammarSpec("regex", f"^(({letter}{{100}}){{100}}){{100}}$")))
            next_hostile = now + args.interval_s
        for out in engine.step():
            if out.request_id == "stream":
                stamps += [time.monotonic()] * len(out.new_token_ids)
            elif out.finished:
                kind = out.error.kind if out.error is not None else out.finish_reason
                ended[kind] = ended.get(kind, 0) + 1
    gaps = np.diff(np.array(stamps)) * 1000
    return dict(mode=mode, tokens=len(stamps), gap_ms_p50=round(float(np.percentile(gaps, 50)), 1),
                gap_ms_p99=round(float(np.percentile(gaps, 99)), 1), gap_ms_max=round(float(gaps.max()), 1),
                gaps_over_150ms=int((gaps > 150).sum()), hostile_ended=ended, load=os.getloadavg()[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--interval-s", type=float, default=0.5)
    parser.add_argument("--modes", default="quiet,after,before")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    cache_dir = tempfile.mkdtemp(prefix="kvgate-hostile-")
    runs = []
    for round_no in range(args.rounds):
        for mode in args.modes.split(","):
            result = run_mode(mode, args, cache_dir) | {"round": round_no}
            print(json.dumps(result), flush=True)
            runs.append(result)
    summary = dict(runs=runs, args=vars(args))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
