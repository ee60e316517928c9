"""Shared by the pipeline-parallel tests: a 6-layer tiny GQA Llama's prompts, transformers' greedy
tokens for them (the reference), engine settings, and one parallel executor at a time (a process
joins one torch.distributed group: a new one closes the last)."""

from __future__ import annotations

import torch
import transformers

from native_backend.config.engine import EngineConfig
from native_backend.execution.factory import make_executor

NUM_LAYERS = 6
PROMPTS = [[(7 * i + 3) % 95 + 1 for i in range(21)], [(5 * i + 11) % 95 + 1 for i in range(10)],
           [(3 * i + 2) % 95 + 1 for i in range(33)], [5, 6, 7]]
NEW_TOKENS = 8


def hf_greedy(checkpoint: str, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """transformers' greedy tokens for every prompt, one at a time."""
    model = transformers.LlamaForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.inference_mode():
        return [model.generate(torch.tensor([p]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                               do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
                for p in prompts]


def config_for(checkpoint: str, **settings) -> EngineConfig:
    settings.setdefault("kv_cache_bytes", 1 << 20)
    return EngineConfig.build(path=checkpoint, num_threads=1, max_num_batched_tokens=16, **settings)


class OneAtATime:
    """Parallel executors by name, built when first asked for; asking for another closes the last."""

    def __init__(self) -> None:
        self.name, self.config, self.executor = None, None, None

    def get(self, name: str, checkpoint: str, tokenizer=None, **settings):
        if name != self.name:
            self.close()
            self.config = config_for(checkpoint, **settings)
            self.executor = make_executor(self.config, tokenizer)
            self.name = name
        return self.config, self.executor

    def close(self) -> None:
        if self.executor is not None:
            self.executor.close()
        self.name, self.config, self.executor = None, None, None


class ByteTokenizer:
    """Enough of a tokenizer for the fp8 calibration text (kv_scales.calibration_ids): the tiny
    model has none. Every rank calibrates on rank 0's ids, so these are the same on every stage."""

    chat_template = None

    @staticmethod
    def encode(text: str) -> list[int]:
        return [b % 95 + 1 for b in text.encode()]
