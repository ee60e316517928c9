"""Where a batched decode step goes (issue 41 item 1): `make serve`'s engine, N decode rows.

Builds the engine with configs/default.yaml's native settings (engine_throughput.py's
`serve_settings`), max_num_seqs = rows, prefills `rows` requests (prompts of --prompt tokens of
pydoc text), then times --steps steps in which every row decodes, each part of a step by wrapping
the call that does it:

    step         OutputProcessor.step: everything one step costs in the engine process
    detokenize   OutputProcessor.step minus the core's step (incremental detokenization, outputs)
    scheduler    the core's step minus the executor's execute (schedule, update, per-token Python)
    inputs       execute minus forward, head and sampling (tensors of the step, metadata)
    forward      the decoder stack (the one-call fused decode step, or the per-layer path)
    head         compute_logits (the LM head)
    sample       the sampler
    pipe         pickling the step's outputs as the engine process sends them to the gateway

Then the decoder stack alone by kind: the same steps through the per-layer path with a timer on
every linear (q/k/v/o/gate/up/down) and on the attention over the paged cache; the per-layer path
calls the kernels the fused step calls, so its split is the fused step's (plus Python's).

    .venv/bin/python bench/decode_profile.py --rows 32 64 --threads 1
    .venv/bin/python bench/decode_profile.py --rows 64 --set kv_cache_dtype=int8
    .venv/bin/python bench/decode_profile.py --rows 64 --set decode_matmul=fp32   # the old path
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pickle
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


CLOCK = time.perf_counter  # --clock cpu: time.process_time (the process's CPU seconds, all its threads)


class Timers:
    """Seconds spent in wrapped calls, by name."""

    def __init__(self):
        self.spent: dict[str, float] = collections.defaultdict(float)

    def wrap(self, obj, attr: str, name: str) -> None:
        inner = getattr(obj, attr)

        def timed(*args, **kwargs):
            started = CLOCK()
            try:
                return inner(*args, **kwargs)
            finally:
                self.spent[name] += CLOCK() - started

        setattr(obj, attr, timed)

    def hook(self, module, name: str) -> None:
        """Forward hooks around a module (the per-layer path's linears and attention)."""
        started = []
        module.register_forward_pre_hook(lambda *_: started.append(CLOCK()))
        module.register_forward_hook(lambda *_: self._stop(name, started))

    def _stop(self, name, started) -> None:
        self.spent[name] += CLOCK() - started.pop()


def parse_set(items: list[str]) -> dict:
    out = {}
    for item in items:
        key, value = item.split("=", 1)
        out[key] = int(value) if value.isdigit() else value
    return out


def build(rows: int, args) -> tuple:
    from engine_runs import make_engine
    from engine_throughput import serve_settings

    from native_backend.model.loader import default_gguf_path

    overrides = {**serve_settings(), "max_num_seqs": rows, "max_num_batched_tokens": max(512, rows),
                 **parse_set(args.set)}
    engine, _ = make_engine({"model": default_gguf_path(), "threads": args.threads, "engine_overrides": overrides})
    return engine, overrides


def prompts(engine_path: str, rows: int, length: int) -> list[list[int]]:
    from pydoc_data.topics import topics

    from native_backend.config.cache_dir import tokenizer_cache_dir
    from native_backend.text.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(engine_path, cache_dir=str(tokenizer_cache_dir()))
    ids = tok.encode("\n\n".join(topics.values()), add_special_tokens=False)
    return [ids[4096 + i * length: 4096 + (i + 1) * length] for i in range(rows)]


def profile(rows: int, args) -> dict:
    from engine_runs import greedy

    from native_backend.core.interface import EngineRequest
    from native_backend.model.loader import default_gguf_path

    engine, overrides = build(rows, args)
    core = engine.core
    executor = core.executor
    runner, model = executor.runner, executor.model
    for i, prompt in enumerate(prompts(default_gguf_path(), rows, args.prompt)):
        engine.add_request(EngineRequest(f"r{i}", prompt, greedy(args.prompt + args.steps * 4)))
    while core.scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in core.scheduler.running):
        engine.step()
    for _ in range(3):  # warm-up decode steps
        engine.step()
    t = Timers()
    t.wrap(engine, "step", "step")
    t.wrap(core, "step", "core_step")
    t.wrap(executor, "execute", "execute")
    t.wrap(model, "forward", "forward")
    t.wrap(model, "compute_logits", "head")
    t.wrap(runner, "_sample", "sample")
    pipe = 0.0
    for _ in range(args.steps):
        outputs = engine.step()
        started = CLOCK()
        pickle.dumps(("outputs", outputs), protocol=pickle.HIGHEST_PROTOCOL)
        pipe += CLOCK() - started
    s, n = t.spent, args.steps
    ms = {
        "step": s["step"], "detokenize": s["step"] - s["core_step"], "scheduler": s["core_step"] - s["execute"],
        "inputs": s["execute"] - s["forward"] - s["head"] - s["sample"], "forward": s["forward"],
        "head": s["head"], "sample": s["sample"], "pipe": pipe,
    }
    ms = {k: round(v / n * 1e3, 2) for k, v in ms.items()}
    kinds = by_kind(model, engine, args)
    return {"rows": rows, "settings": overrides, "ms_per_step": ms, "decode_tok_s": round(rows / (ms["step"] / 1e3), 1),
            "stack_by_kind_ms": kinds, "fused": model.fused_decode is not None}


def by_kind(model, engine, args) -> dict:
    """The decoder stack through the per-layer path, each linear kind and the attention timed."""
    t = Timers()
    for layer in model.decoder_layers():
        a, m = layer.self_attn, layer.mlp
        for name, mod in (("q", a.q_proj), ("k", a.k_proj), ("v", a.v_proj), ("o", a.o_proj),
                          ("gate", m.gate_proj), ("up", m.up_proj), ("down", m.down_proj), ("attention", a.attn)):
            t.hook(mod, name)
    fused, model.fused_decode = model.fused_decode, None
    t.wrap(model, "forward", "forward")
    t.wrap(model, "compute_logits", "head")
    try:
        for _ in range(args.steps):
            engine.step()
    finally:
        model.fused_decode = fused
    spent = dict(t.spent)
    spent["per-layer python and small ops"] = spent["forward"] - sum(
        v for k, v in spent.items() if k not in ("forward", "head"))
    return {k: round(v / args.steps * 1e3, 2) for k, v in spent.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[32, 64])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--prompt", type=int, default=256, help="prompt tokens per row")
    parser.add_argument("--set", action="append", default=[], help="engine setting override, key=value")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="cpu",
                        help="cpu (default): the process's CPU seconds, which a loaded box's waits for a core do not "
                             "inflate (with --threads 1 the step's own work); wall: seconds of wall time")
    parser.add_argument("--out", help="JSON path")
    args = parser.parse_args()
    global CLOCK
    CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter
    results = []
    for rows in args.rows:
        load = os.getloadavg()[0]
        result = {**profile(rows, args), "clock": args.clock, "load_before": round(load, 2),
                  "load_after": round(os.getloadavg()[0], 2)}
        print(json.dumps(result), flush=True)
        results.append(result)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
