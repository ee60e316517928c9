"""Micro-benchmark of the native engine's model steps on CPU, side by side with transformers.

In one process, on the default model (SmolLM2-135M-Instruct, GGUF, fp32):

- prefill of a 256-token prompt through our ModelRunner (paged KV cache, one step);
- batch-1 decode at context ~256-320: our runner step vs transformers' `LlamaForCausalLM` (loaded
  from the same GGUF file) stepping with its own KV cache; the two alternate in rounds so that
  load from other processes hits both alike;
- our decode step (schedule-free: hand-made batches through `ModelRunner.execute`, which includes
  preparing inputs and greedy sampling) at batch 1, 8, 16 and 32, contexts spread around 300.

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

from native_backend.batch import ScheduledChunk, SchedulerOutput  # noqa: E402
from native_backend.kv_cache import KVCache  # noqa: E402
from native_backend.loader import default_gguf_path, load_model  # noqa: E402
from native_backend.model_runner import ModelRunner  # noqa: E402
from native_backend.sampling_params import SamplingParams  # noqa: E402

BLOCK_SIZE = 16
PROMPT_LEN = 256
GREEDY = SamplingParams(temperature=0.0)


def median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


class Ours:
    def __init__(self, num_blocks: int = 1024):
        self.model = load_model(None)
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
    ours = Ours()
    vocab = ours.model.config.vocab_size
    prompt = torch.randint(100, vocab - 100, (PROMPT_LEN,), generator=gen).tolist()
    hf = None if args.no_hf else HF()

    with torch.inference_mode():
        # Prefill: same 256 tokens into fresh blocks each time.
        ours.prefill(prompt, ours.blocks(PROMPT_LEN))
        prefill = [ours.prefill(prompt, ours.blocks(PROMPT_LEN))[0] for _ in range(max(3, reps // 2))]

        # Batch-1 decode, ours and HF alternating (context 257 .. 256 + steps).
        ours_b1, hf_b1 = [], []
        ours.decode_run(prompt, 4)
        if hf:
            hf.decode_run(prompt, 4)
        for _ in range(rounds):
            ours_b1 += ours.decode_run(prompt, steps)
            if hf:
                hf_b1 += hf.decode_run(prompt, steps)

        batched = {b: ours.batch_decode(b, reps) for b in (1, 8, 16, 32)}

    result = {
        "label": args.label,
        "model": os.path.basename(default_gguf_path()),
        "threads": args.threads,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "loadavg_at_end": os.getloadavg(),
        "prefill_256_ms": median_ms(prefill),
        "prefill_256_tok_per_s": PROMPT_LEN / statistics.median(prefill),
        "decode_b1": {
            "ours_ms": median_ms(ours_b1),
            "ours_tok_per_s": 1 / statistics.median(ours_b1),
            "hf_ms": median_ms(hf_b1) if hf_b1 else None,
            "hf_tok_per_s": 1 / statistics.median(hf_b1) if hf_b1 else None,
            "ours_over_hf_speed": statistics.median(hf_b1) / statistics.median(ours_b1) if hf_b1 else None,
        },
        "decode_batched": {
            str(b): {"step_ms": median_ms(t), "tok_per_s": b / statistics.median(t)} for b, t in batched.items()
        },
    }

    print(f"\nengine step benchmark ({args.threads} threads, torch {torch.__version__}, load {result['loadavg_at_end'][0]:.1f})")
    print(f"  prefill 256 tokens (ours)         {result['prefill_256_ms']:8.1f} ms   {result['prefill_256_tok_per_s']:7.1f} tok/s")
    d = result["decode_b1"]
    print(f"  decode batch 1, ctx ~{PROMPT_LEN}-{PROMPT_LEN + steps}:")
    print(f"    ours                            {d['ours_ms']:8.1f} ms   {d['ours_tok_per_s']:7.1f} tok/s")
    if hf_b1:
        print(f"    transformers (DynamicCache)     {d['hf_ms']:8.1f} ms   {d['hf_tok_per_s']:7.1f} tok/s"
              f"   (ours {d['ours_over_hf_speed']:.2f}x)")
    print("  decode step (ours), ctx ~300:      batch    step ms     tok/s")
    for b, r in result["decode_batched"].items():
        print(f"                                    {b:>5} {r['step_ms']:10.1f} {r['tok_per_s']:9.1f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
