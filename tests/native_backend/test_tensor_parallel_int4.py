"""Tensor parallelism with int4 weights: SmolLM2's GGUF Q4_1 linears run packed (quantization
gguf) at TP 3 give TP 1's logits within 1e-4 (the int4 groups of 32 split whole: 192 of o_proj's
inputs and 512 of down_proj's a rank; the LM head's int8 copy splits by vocabulary rows). Its own
module: a process holds one tensor-parallel group at a time."""

from __future__ import annotations

import pytest
import torch

from native_backend.engine_config import EngineConfig
from native_backend.executor import make_executor
from native_backend.loader import default_gguf_path
from native_backend.tokenizer import Tokenizer
from tensor_parallel_checks import max_difference, run_script, smollm2_prompts

pytestmark = pytest.mark.timeout(1200)


def build(tp: int):
    return make_executor(EngineConfig.build(path=default_gguf_path(), num_threads=1, tensor_parallel_size=tp,
                                            kv_cache_bytes=64 << 20, quantization="gguf"))


def test_gguf_int4_linears_split_across_three_ranks_match_one_rank(tmp_path):
    torch.set_num_threads(1)
    prompts = smollm2_prompts(Tokenizer.from_pretrained(default_gguf_path(), cache_dir=tmp_path))[:2]
    one = build(1)
    logits_1, fed = run_script(one, prompts, 8)
    three = build(3)
    try:
        logits_3, _ = run_script(three, prompts, 8, feed=fed)
        assert "linears int4 GGUF Q4_1" in three.describe()
    finally:
        three.close()
    assert max_difference(logits_3, logits_1) < 1e-4
