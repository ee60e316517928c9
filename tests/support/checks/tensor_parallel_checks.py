"""Shared by the tensor-parallel tests: a tiny GQA Llama checkpoint, a fixed script of prefill and
decode steps run through an executor's `compute_logits` (rank 0 gathers the whole vocabulary's
logits from every rank), and an engine's tokens (greedy, or as sampled) for a batch of prompts."""

from __future__ import annotations

import torch
import transformers

from native_backend.config.engine import EngineConfig
from native_backend.core.batch import ScheduledChunk, SchedulerOutput
from native_backend.core.interface import EngineRequest
from native_backend.core.sampling_params import SamplingParams
from native_backend.execution.factory import make_executor

GREEDY = SamplingParams(temperature=0.0)
BLOCK = 16


def tiny_gqa_llama(path, num_layers: int = 2) -> str:
    """8 query heads, 2 KV heads (TP 2 splits them, TP 4 replicates each on two ranks), MLP 112,
    vocabulary 96: valid TP sizes 1, 2, 4, 8; `num_layers` decoder layers (pipeline stages split them)."""
    config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=num_layers, num_attention_heads=8,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=128, rope_theta=500.0,
        initializer_range=0.15)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).eval().save_pretrained(path, safe_serialization=True)
    return str(path)


def executor_for(path: str, tp: int, **settings):
    settings.setdefault("kv_cache_bytes", 1 << 20)
    return make_executor(EngineConfig.build(path=path, num_threads=1, tensor_parallel_size=tp, **settings))


def table(first_block: int, num_tokens: int) -> list[int]:
    return list(range(first_block, first_block + -(-num_tokens // BLOCK)))


def run_script(executor, prompts: list[list[int]], decode_steps: int, feed: list[dict] | None = None):
    """Prefill every prompt (the first in two chunks, so a chunk that does not sample is in the
    mix), then `decode_steps` steps of one token per prompt: the greedy token of this run, or of
    `feed` (another run's record) so that two runs see the same inputs. Returns (logits per step:
    {request: (rows, vocab)}, the tokens fed per step)."""
    ids = [f"r{i}" for i in range(len(prompts))]
    first = [1 + 16 * i for i in range(len(prompts))]  # each request's own run of blocks (up to 256 tokens)
    half = BLOCK if len(prompts[0]) > BLOCK else len(prompts[0]) - 1
    steps = [SchedulerOutput([ScheduledChunk(ids[0], prompts[0][:half], 0, table(first[0], half), False, GREEDY)]),
             SchedulerOutput([ScheduledChunk(ids[0], prompts[0][half:], half, table(first[0], len(prompts[0])), True,
                                             GREEDY)] +
                             [ScheduledChunk(r, p, 0, table(b, len(p)), True, GREEDY)
                              for r, p, b in zip(ids[1:], prompts[1:], first[1:])])]
    logits = [executor.compute_logits(s, all_tokens=True) for s in steps]
    last = {r: rows[-1] for r, rows in logits[1].items()}
    lengths = {r: len(p) for r, p in zip(ids, prompts)}
    fed = []
    for step in range(decode_steps):
        tokens = feed[step] if feed is not None else {r: int(last[r].argmax()) for r in ids}
        fed.append(tokens)
        chunks = [ScheduledChunk(r, [tokens[r]], lengths[r] + step, table(b, lengths[r] + step + 1), True, GREEDY)
                  for r, b in zip(ids, first)]
        out = executor.compute_logits(SchedulerOutput(chunks))
        logits.append(out)
        last = {r: rows[-1] for r, rows in out.items()}
    return logits, fed


def greedy_tokens(engine, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Every prompt's greedy tokens from an engine (make_engine_core), the prompts batched as it schedules them."""
    return engine_tokens(engine, prompts, SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True))


def engine_tokens(engine, prompts: list[list[int]], sampling: SamplingParams) -> list[list[int]]:
    """Every prompt's tokens from an engine (make_engine_core) with these sampling settings, batched."""
    for i, prompt in enumerate(prompts):
        engine.add_request(EngineRequest(f"r{i}", prompt, sampling))
    tokens = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for out in engine.step():
            assert out.error is None, out.error
            tokens[out.request_id].extend(out.new_token_ids)
    return [tokens[f"r{i}"] for i in range(len(prompts))]


def smollm2_prompts(tokenizer) -> list[list[int]]:
    """Four prompts of 23-97 tokens from real English text (the first longer than a block)."""
    import pydoc_data.topics

    ids = tokenizer.encode(" ".join(list(pydoc_data.topics.topics.values())[:10]))
    return [ids[:23], ids[100:160], ids[300:397], ids[500:531]]


def transformers_greedy(prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """The reference: transformers' generate on the same GGUF file (fp32), one prompt at a time."""
    import os

    from transformers import AutoModelForCausalLM

    from native_backend.model.loader import default_gguf_path

    path = default_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                 dtype=torch.float32).eval()
    with torch.inference_mode():
        return [model.generate(torch.tensor([p]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                               do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
                for p in prompts]


def max_difference(a: list[dict], b: list[dict]) -> float:
    return max(float((x[r] - y[r]).abs().max()) for x, y in zip(a, b, strict=True) for r in x)
