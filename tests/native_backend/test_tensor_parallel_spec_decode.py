"""Speculative decoding (n-gram drafts) under tensor parallelism on the real default model,
SmolLM2-135M (fp32) at TP 3 with gloo on CPU (its own module: a process holds one tensor-parallel
group at a time).

Rank 0 finds the drafts and verifies them; every rank runs the verification's k + 1 rows, and the
workers follow rank 0's rollback of rejected drafts through the next step's positions and block
tables alone. Greedy tokens at TP 3 with speculation equal TP 1's without, token for token, on
prompts that repeat themselves (drafts are accepted: the engine's counters say so, so the test
cannot pass with speculation silently off), batched with a prompt whose drafts mostly miss, and
with prefill chunks sharing steps with verifications; every KV block comes back. Seeded sampling
(rank 0 alone draws, rejection sampling with one-hot drafts) emits TP 1's plain tokens too.
"""

from __future__ import annotations

import pytest
import torch

from native_backend.config.engine import EngineConfig
from native_backend.core.sampling_params import SamplingParams
from native_backend.model.loader import default_gguf_path
from native_backend.process.factory import make_engine_core
from native_backend.process.output_processor import OutputProcessor
from tests.support.checks.tensor_parallel_checks import engine_tokens, greedy_tokens, smollm2_prompts

pytestmark = pytest.mark.timeout(900)

NEW_TOKENS = 32
SEEDED = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.7, top_p=0.9, seed=11, ignore_eos=True)
PASSAGE = ("The quick brown fox jumps over the lazy dog. The dog sleeps in the sun while the fox runs "
           "into the forest, where the trees are tall and the river is cold.")
CODE = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n"


def engine(cache_dir: str, tp: int, speculative=None) -> OutputProcessor:
    # A budget of 64 tokens: the long prompt's prefill chunks share steps with the others' verifications.
    return make_engine_core(EngineConfig.build(path=default_gguf_path(), tokenizer_cache_dir=cache_dir, num_threads=1,
                                        tensor_parallel_size=tp, kv_cache_bytes=64 << 20, max_num_seqs=8,
                                        max_num_batched_tokens=64, speculative=speculative))


def test_ngram_speculation_at_tp3_gives_tp1_plain_tokens_greedy_and_seeded(tmp_path):
    torch.set_num_threads(1)
    cache = str(tmp_path)
    one = engine(cache, 1)
    tokenizer = one.tokenizer
    prompts = [tokenizer.encode(CODE), tokenizer.encode(f"{PASSAGE}\n\nThe same passage again:\n{PASSAGE[:40]}"),
               smollm2_prompts(tokenizer)[0]]
    expected, expected_seeded = greedy_tokens(one, prompts, NEW_TOKENS), engine_tokens(one, prompts, SEEDED)
    three = engine(cache, 3, speculative={"method": "ngram", "num_speculative_tokens": 4})
    try:
        got = greedy_tokens(three, prompts, NEW_TOKENS)
        stats, line = three.stats(), three.describe()
        got_seeded = engine_tokens(three, prompts, SEEDED)
        seeded_accepted = three.stats().spec_decode_num_accepted_tokens - stats.spec_decode_num_accepted_tokens
        bm = three.core.scheduler.block_manager
        free, total = bm.num_free_blocks, bm.num_blocks
    finally:
        three.core.executor.close()
    assert "3 tensor-parallel ranks" in line
    assert got == expected
    print(f"TP 3 ngram: {stats.spec_decode_num_accepted_tokens} of {stats.spec_decode_num_draft_tokens} drafts "
          f"accepted over {stats.spec_decode_num_drafts} verifications, per position "
          f"{stats.spec_decode_num_accepted_tokens_per_pos}; seeded: {seeded_accepted} drafts accepted")
    assert stats.spec_decode_num_drafts > 0 and stats.spec_decode_num_accepted_tokens > 0  # speculation ran
    assert stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens  # and some were rolled back
    assert free == total  # rejected drafts' blocks included
    assert got_seeded == expected_seeded and seeded_accepted > 0
