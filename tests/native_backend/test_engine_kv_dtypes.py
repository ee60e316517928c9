"""The whole engine on the default model with each quantized KV cache: a cache so small that
requests are preempted and recomputed, chunked prefill, prefix-cache hits and abort all work
unchanged; no block leaks; and the greedy text stays close to the float32 cache's."""

from __future__ import annotations

import pydoc_data.topics
import pytest

from native_backend.config.engine import EngineConfig
from native_backend.core.interface import EngineRequest
from native_backend.core.sampling_params import SamplingParams
from native_backend.model.loader import default_gguf_path
from native_backend.process.factory import make_engine_core
from native_backend.process.output_processor import OutputProcessor
from tests.support.checks.engine_checks import assert_abort_frees_every_block

pytestmark = pytest.mark.timeout(900)

NEW_TOKENS = 16
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
# ~6 sequences of ~100 tokens at float32: 30 layers x 3 KV heads x 64 x 4 B x 2 = 46 KiB a token.
# Prompts (of 8) whose first 6 tokens must match the float32 cache's: e5m2 keeps 2 mantissa bits.
MIN_AGREEMENT = {"fp8_e4m3": 6, "int8": 6, "fp8_e5m2": 4}
SMALL_CACHE = {"float32": 24 << 20, "fp8_e4m3": 6 << 20, "fp8_e5m2": 6 << 20, "int8": 6 << 20}


@pytest.fixture(scope="module")
def make_engine(tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("tok"))

    def make(kv_cache_dtype: str) -> OutputProcessor:
        return make_engine_core(EngineConfig.build(path=default_gguf_path(), tokenizer_cache_dir=cache, num_threads=2,
                                            kv_cache_dtype=kv_cache_dtype, kv_cache_bytes=SMALL_CACHE[kv_cache_dtype],
                                            max_num_seqs=8, max_num_batched_tokens=64))
    return make


@pytest.fixture(scope="module")
def prompts(make_engine):
    text = " ".join(list(pydoc_data.topics.topics.values())[50:60])
    ids = make_engine("float32").tokenizer.encode(text)
    return [ids[i * 90: i * 90 + 60 + 7 * i] for i in range(8)]


def run(engine: OutputProcessor, prompts, tag: str) -> list[list[int]]:
    for i, p in enumerate(prompts):
        engine.add_request(EngineRequest(f"{tag}{i}", p, GREEDY))
    out = {f"{tag}{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for o in engine.step():
            assert o.error is None
            out[o.request_id].extend(o.new_token_ids)
    assert engine.core.scheduler.block_manager.num_free_blocks == engine.core.plan.num_blocks  # nothing leaked
    return [out[f"{tag}{i}"] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def float32_tokens(make_engine, prompts):
    return run(make_engine("float32"), prompts, "f")


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2", "int8"])
def test_preemption_prefix_cache_and_abort_with_a_quantized_cache(make_engine, prompts, float32_tokens, kv_cache_dtype):
    engine = make_engine(kv_cache_dtype)
    assert kv_cache_dtype in engine.describe()
    first = run(engine, prompts, "a")
    stats = engine.stats()
    assert stats.num_preemptions > 0  # the small cache forced recomputation
    assert all(len(t) == NEW_TOKENS for t in first)
    # The same prompts again: their prefixes come from the cache, the text does not change.
    second = run(engine, prompts, "b")
    assert engine.stats().prefix_cache_hits > stats.prefix_cache_hits
    differ = [i for i, (a, b) in enumerate(zip(first, second)) if a != b]
    print(kv_cache_dtype, "prompts whose text changed with a prefix-cache hit:", differ)
    assert differ == []
    # Close to the float32 cache: the first tokens agree for most prompts.
    agree = sum(q[:6] == f[:6] for q, f in zip(first, float32_tokens))
    assert agree >= MIN_AGREEMENT[kv_cache_dtype], (kv_cache_dtype, agree)
    assert_abort_frees_every_block(engine, prompts[3], GREEDY)


CHAT_QUESTIONS = ("What is the capital of France?", "Translate 'good morning' into Spanish",
                  "Name three primary colors.", "Write a haiku about the sea.")


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_clamps_are_counted_and_calibrated_scales_clamp_no_chat_prompt(make_engine, kv_cache_dtype):
    engine = make_engine(kv_cache_dtype)
    chats = [engine.tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in CHAT_QUESTIONS]
    answers = run(engine, chats, "chat")
    # The question that is a near tie in the model (test_kv_capital.py), through the engine: its own
    # calibration at start-up (no checkpoint scales in the GGUF), not a hand-wired cache.
    assert engine.tokenizer.decode(answers[0]).startswith("The capital of France is Paris"), \
        engine.tokenizer.decode(answers[0])
    stats = engine.stats()
    # The calibrated scales (stdlib docstrings and chat turns, 2x headroom) cover every K and V the
    # template's prompts and their answers produce, prefill and decode alike.
    assert (stats.kv_clamped_keys, stats.kv_clamped_values) == (0, 0)
    layer = engine.core.executor.kv_cache.layer(3)
    layer.k_scale /= 1000  # now a layer's largest keys are far beyond the format's range
    # a new question: its prompt's new tokens are written through the (shrunk) scale at prefill
    run(engine, [engine.tokenizer.apply_chat_template([{"role": "user", "content": "Who wrote Hamlet?"}])], "small")
    stats = engine.stats()
    assert stats.kv_clamped_keys > 0 and stats.kv_clamped_values == 0
    assert stats.kv_clamped_keys == int(layer.clamped[0].sum())
