"""Micro-benchmark of the native engine's model steps on CPU, side by side with transformers.

In one process, on the default model (SmolLM2-135M-Instruct, GGUF, fp32):

- prefill of a 256-token prompt through our ModelRunner (paged KV cache, one step);
- batch-1 decode at context ~256-320: our runner step vs transformers' `LlamaForCausalLM` (loaded
  from the same GGUF file) stepping with its own KV cache; the two alternate in rounds so that
  load from other processes hits both alike;
- our decode step (schedule-free: hand-made batches through `ModelRunner.execute`, which includes
  preparing inputs and greedy sampling) at batch 1, 8, 16, 32 and 64, contexts spread around 300;
- a sweep of every linear layer of the model at M rows, the C kernel against `F.linear` (MKL).

"ours" runs with the engine's CPU kernels (C paged decode attention, C small-batch linears),
"ours_torch" with torch alone (`EngineConfig.cpu_kernels=False`), side by side in one process.

Every number is the median over repetitions; the machine is shared, so compare within one run.

    .venv/bin/python bench/engine_step_bench.py [--threads 2] [--quick]

Writes bench/results/engine_step_bench.json.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
try:
    import native_backend  # noqa: F401  (an installed or PYTHONPATH copy wins: lets a baseline run)
except ImportError:
    sys.path.insert(0, str(ROOT))

from native_backend.core.batch import ScheduledChunk, SchedulerOutput  # noqa: E402
from native_backend.core.sampling_params import SamplingParams  # noqa: E402
from native_backend.execution.model_runner import ModelRunner  # noqa: E402
from native_backend.model.kv_cache import KVCache  # noqa: E402
from native_backend.model.layers.context import LayerContext  # noqa: E402
from native_backend.model.loader import default_gguf_path, load_model  # noqa: E402

BLOCK_SIZE = 16
PROMPT_LEN = 256
GREEDY = SamplingParams(temperature=0.0)


def median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


class Ours:
    def __init__(self, num_blocks: int = 1024, cpu_kernels: bool = True):
        self.model = load_model(None, LayerContext.for_device("cpu", torch.float32, cpu_kernels=cpu_kernels))
        self.kernels = self.model.ctx.kernels
        self.cache = KVCache.for_model(self.model.config, num_blocks=num_blocks, block_size=BLOCK_SIZE)
        self.runner = ModelRunner(self.model, self.cache)
        self._next_block = 1

    def blocks(self, num_tokens: int) -> list[int]:
        n = -(-num_tokens // BLOCK_SIZE)
        if self._next_block + n > self.cache.num_blocks:
            self._next_block = 1
        table = list(range(self._next_block, self._next_block + n))
        self._next_block += n
        return table

    def prefill(self, prompt: list[int], table: list[int]) -> tuple[float, int]:
        chunk = ScheduledChunk("p", list(prompt), 0, table, True, GREEDY)
        t0 = time.perf_counter()
        out = self.runner.execute(SchedulerOutput([chunk]))
        return time.perf_counter() - t0, out.sampled_token_ids["p"][0]

    def decode_run(self, prompt: list[int], steps: int) -> list[float]:
        """Prefill, then `steps` greedy batch-1 decode steps; the time of each decode step."""
        table = self.blocks(len(prompt) + steps + 1)
        _, token = self.prefill(prompt, table)
        times, pos = [], len(prompt)
        for _ in range(steps):
            chunk = ScheduledChunk("p", [token], pos, table, True, GREEDY)
            t0 = time.perf_counter()
            out = self.runner.execute(SchedulerOutput([chunk]))
            times.append(time.perf_counter() - t0)
            token, pos = out.sampled_token_ids["p"][0], pos + 1
        return times

    def batch_decode(self, batch: int, reps: int, base_ctx: int = 300) -> list[float]:
        """One decode token for each of `batch` sequences with contexts spread around base_ctx."""
        ctxs = [base_ctx - 30 + (37 * i) % 61 for i in range(batch)] if batch > 1 else [base_ctx]
        tables = [self.blocks(c + 1) for c in ctxs]
        chunks = [ScheduledChunk(f"r{i}", [7 + i], c, t, True, GREEDY) for i, (c, t) in enumerate(zip(ctxs, tables))]
        sched = SchedulerOutput(chunks)
        self.runner.execute(sched)  # warm-up (KV of the earlier positions is whatever is there: fine)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            self.runner.execute(sched)
            times.append(time.perf_counter() - t0)
        return times


class HF:
    def __init__(self):
        from transformers import AutoModelForCausalLM

        path = default_gguf_path()
        self.model = AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
        ).eval()

    @torch.inference_mode()
    def decode_run(self, prompt: list[int], steps: int) -> list[float]:
        from transformers import DynamicCache

        cache = DynamicCache()  # filled in place by every forward
        kw = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        out = self.model(torch.tensor([prompt]), use_cache=True, **{kw: cache})
        token = int(out.logits[0, -1].argmax())
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            out = self.model(torch.tensor([[token]]), use_cache=True, **{kw: cache})
            token = int(out.logits[0, -1].argmax())
            times.append(time.perf_counter() - t0)
        return times


def linear_sweep(model, rows: list[int], reps: int) -> dict:
    """Every linear layer of the model (30 layers + lm_head, the weights streamed from memory as
    in a real step) at M rows: the C kernel against F.linear, alternating."""
    import torch.nn.functional as F

    from native_backend.kernels import cpu_kernels
    from native_backend.model.layers.linear import LinearBase

    layers = [m for m in model.modules() if isinstance(m, LinearBase)]
    result = {}
    for m in rows:
        xs = {n: torch.randn(m, n) for n in {lin.in_features for lin in layers}}
        times = {"kernel": [], "torch": []}
        for _ in range(reps):
            for name, fn in (("kernel", cpu_kernels.linear), ("torch", F.linear)):
                t0 = time.perf_counter()
                for lin in layers:
                    fn(xs[lin.in_features], lin.weight, lin.bias)
                times[name].append(time.perf_counter() - t0)
        k, t = median_ms(times["kernel"]), median_ms(times["torch"])
        result[str(m)] = {"kernel_ms": k, "torch_ms": t, "torch_over_kernel": t / k}
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    ap.add_argument("--no-hf", action="store_true", help="skip transformers")
    ap.add_argument("--label", default="", help="a note stored in the JSON (e.g. 'baseline')")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "engine_step_bench.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rounds, steps, reps = (2, 16, 5) if args.quick else (3, 32, 9)

    gen = torch.Generator().manual_seed(0)
    systems = {"ours": Ours(cpu_kernels=True), "ours_torch": Ours(cpu_kernels=False)}
    vocab = systems["ours"].model.config.vocab_size
    prompt = torch.randint(100, vocab - 100, (PROMPT_LEN,), generator=gen).tolist()
    hf = None if args.no_hf else HF()
    decoders = {**systems, **({"hf": hf} if hf else {})}

    with torch.inference_mode():
        prefill = {}
        for name, ours in systems.items():  # same 256 tokens into fresh blocks each time
            ours.prefill(prompt, ours.blocks(PROMPT_LEN))
            prefill[name] = [ours.prefill(prompt, ours.blocks(PROMPT_LEN))[0] for _ in range(max(3, reps // 2))]

        # Batch-1 decode, the systems alternating (context 257 .. 256 + steps).
        b1 = {name: [] for name in decoders}
        for d in decoders.values():
            d.decode_run(prompt, 4)
        for _ in range(rounds):
            for name, d in decoders.items():
                b1[name] += d.decode_run(prompt, steps)

        batches = (1, 8, 16, 32, 64)
        batched = {name: {b: ours.batch_decode(b, reps) for b in batches} for name, ours in systems.items()}
        sweep = linear_sweep(systems["ours"].model, [1, 2, 4, 8, 16, 32, 64, 128, 192, 256, 512], max(3, reps // 2))

    b1_s = {name: statistics.median(t) for name, t in b1.items()}
    result = {
        "label": args.label,
        "model": os.path.basename(default_gguf_path()),
        "threads": args.threads,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "kernels": {name: ours.kernels for name, ours in systems.items()},
        "loadavg_at_end": os.getloadavg(),
        "prefill_256_ms": {name: median_ms(t) for name, t in prefill.items()},
        "decode_b1": {
            **{f"{name}_ms": t * 1e3 for name, t in b1_s.items()},
            **{f"{name}_tok_per_s": 1 / t for name, t in b1_s.items()},
            "ours_over_hf_speed": b1_s["hf"] / b1_s["ours"] if hf else None,
            "ours_over_ours_torch_speed": b1_s["ours_torch"] / b1_s["ours"],
        },
        "decode_batched": {
            name: {str(b): {"step_ms": median_ms(t), "tok_per_s": b / statistics.median(t)} for b, t in runs.items()}
            for name, runs in batched.items()
        },
        "linear_sweep_ms": sweep,
    }
    print_report(result, steps)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


def print_report(r: dict, steps: int) -> None:
    print(f"\nengine step benchmark ({r['threads']} threads, torch {r['torch']}, load {r['loadavg_at_end'][0]:.1f})")
    print(f"  ours = {r['kernels']['ours']}; ours_torch = {r['kernels']['ours_torch']}")
    for name, ms in r["prefill_256_ms"].items():
        print(f"  prefill {PROMPT_LEN} tokens ({name:10})   {ms:8.1f} ms   {PROMPT_LEN / ms * 1e3:7.1f} tok/s")
    d = r["decode_b1"]
    print(f"  decode batch 1, ctx ~{PROMPT_LEN}-{PROMPT_LEN + steps}:")
    for name in ("ours", "ours_torch", "hf"):
        if f"{name}_ms" in d:
            print(f"    {name:12}                    {d[name + '_ms']:8.1f} ms   {d[name + '_tok_per_s']:7.1f} tok/s")
    if d["ours_over_hf_speed"]:
        print(f"    ours vs transformers: {d['ours_over_hf_speed']:.2f}x; vs ours_torch: {d['ours_over_ours_torch_speed']:.2f}x")
    print("  decode step, ctx ~300:   batch   ours ms  ours_torch ms   speed-up")
    for b, o in r["decode_batched"]["ours"].items():
        t = r["decode_batched"]["ours_torch"][b]
        print(f"                          {b:>5} {o['step_ms']:9.1f} {t['step_ms']:14.1f} {t['step_ms'] / o['step_ms']:9.2f}x")
    print("  all linear layers at M rows:   M   kernel ms   F.linear ms   F.linear/kernel")
    for m, x in r["linear_sweep_ms"].items():
        print(f"                             {m:>5} {x['kernel_ms']:10.1f} {x['torch_ms']:12.1f} {x['torch_over_kernel']:12.2f}")


if __name__ == "__main__":
    main()
