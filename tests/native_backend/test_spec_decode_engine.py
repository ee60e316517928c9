"""Speculative decoding through the whole engine on the real default model (SmolLM2-135M).

Greedy with speculation must be token-identical to greedy without: 16 prompts x 64 tokens under
continuous batching (speculating rows, plain decodes and prefill chunks share steps). A seeded
sampled request with n-gram drafts emits the tokens it emits without them (the sampler rewinds
its generator past rejected positions). Every block comes back.
"""

import pydoc_data.topics
import pytest

from native_backend.config.engine import EngineConfig
from native_backend.core.interface import EngineRequest
from native_backend.core.sampling_params import SamplingParams
from native_backend.model.loader import default_gguf_path
from native_backend.process.factory import make_engine_core

pytestmark = pytest.mark.timeout(1800)

NUM_PROMPTS, NEW_TOKENS = 16, 64
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
NGRAM = dict(method="ngram", num_speculative_tokens=4, max_batch_size=None)


@pytest.fixture(scope="module")
def make_engine(tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("tok"))

    def make(speculative=None, **overrides):
        settings = dict(max_num_batched_tokens=64, max_num_seqs=16, kv_cache_bytes=256 << 20, **overrides)
        return make_engine_core(EngineConfig.build(path=default_gguf_path(), tokenizer_cache_dir=cache, num_threads=2,
                                            speculative=speculative, **settings))

    return make


@pytest.fixture(scope="module")
def plain(make_engine):
    return make_engine()


@pytest.fixture(scope="module")
def prompts(plain):
    text = " ".join(list(pydoc_data.topics.topics.values())[:40])
    ids = plain.tokenizer.encode(text)
    return [ids[i * 60 : i * 60 + 20 + 9 * i] for i in range(NUM_PROMPTS)]  # 20 .. 155 tokens


@pytest.fixture(scope="module")
def plain_greedy(plain, prompts):
    return run_all(plain, prompts, GREEDY)


def run_all(engine, prompts, sampling) -> list[list[int]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(EngineRequest(f"r{i}", prompt, sampling))
    tokens = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for out in engine.step():
            assert out.error is None
            tokens[out.request_id] += out.new_token_ids
    bm = engine.core.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks  # nothing leaked, rejected drafts included
    return [tokens[f"r{i}"] for i in range(len(prompts))]


def test_ngram_greedy_is_token_identical(make_engine, prompts, plain_greedy, monkeypatch):
    engine = make_engine(NGRAM)
    executor, slots = engine.core.executor, []  # (slots, drafts) of each chunk given slots

    def propose(scheduled, real=executor.propose):
        filled, probs = real(scheduled)
        slots.extend((c.num_spec_tokens, len(c.draft_token_ids)) for c in filled.chunks if c.num_spec_tokens)
        return filled, probs

    monkeypatch.setattr(executor, "propose", propose)
    assert run_all(engine, prompts, GREEDY) == plain_greedy
    assert slots and all(num_slots == num_drafts for num_slots, num_drafts in slots)  # no slot held in vain
    stats = engine.stats()
    assert stats.spec_decode_num_drafts > 0 and 0 < stats.spec_decode_num_accepted_tokens
    assert stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens  # some were rejected
    per_pos = stats.spec_decode_num_accepted_tokens_per_pos
    assert sum(per_pos) == stats.spec_decode_num_accepted_tokens and list(per_pos) == sorted(per_pos, reverse=True)


def test_seeded_sampling_emits_the_same_tokens_with_ngram_drafts(make_engine, plain, prompts):
    sampling = SamplingParams(max_tokens=32, temperature=0.7, top_p=0.9, repetition_penalty=1.1, seed=11,
                              ignore_eos=True)
    engine = make_engine(NGRAM)
    first = run_all(engine, prompts[:4], sampling)
    assert run_all(plain, prompts[:4], sampling) == first
    assert engine.stats().spec_decode_num_accepted_tokens > 0
    assert run_all(make_engine(NGRAM), prompts[:4], sampling) == first  # and again


def test_self_speculative_draft_greedy_is_token_identical(make_engine, prompts, plain_greedy):
    # A 4-layer early exit of SmolLM2 is a poor guesser: drafts are rejected and accepted, and the
    # policy must not pause (min_acceptance_rate 0) so that every step verifies.
    engine = make_engine(dict(method="draft", draft_num_layers=4, num_speculative_tokens=3, max_batch_size=None,
                              min_acceptance_rate=0.0))
    assert run_all(engine, prompts, GREEDY) == plain_greedy
    stats = engine.stats()
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens


def test_a_draft_model_equal_to_the_target_is_always_accepted(make_engine, prompts, plain_greedy):
    engine = make_engine(dict(method="draft", draft_model=default_gguf_path(), num_speculative_tokens=2,
                              max_batch_size=None))
    assert run_all(engine, prompts[:4], GREEDY) == plain_greedy[:4]
    stats = engine.stats()
    assert stats.spec_decode_num_draft_tokens > 0
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens  # acceptance 1.0
    # Sampled with a seed: still all accepted (p == q), and reproducible.
    sampling = SamplingParams(max_tokens=16, temperature=0.8, seed=3, ignore_eos=True)
    first = run_all(engine, prompts[:2], sampling)
    assert run_all(engine, prompts[:2], sampling) == first


def test_an_int4_copy_of_the_target_drafts_token_identically(make_engine, prompts, plain_greedy, tmp_path_factory):
    """The draft named by draft_model may be an AWQ int4 directory (`kvgate quantize`; RTN here
    for speed, the same AutoAWQ GEMM files): it proposes, the float target verifies, and greedy
    output is the float model's whatever the draft guessed."""
    from native_backend.model.quantization.method import describe_weights
    from native_backend.tools.quantize import QuantizeOptions, quantize_model

    int4_dir = str(tmp_path_factory.mktemp("smollm2-int4"))
    quantize_model(default_gguf_path(), int4_dir, QuantizeOptions(method="rtn", group_size=64))
    engine = make_engine(dict(method="draft", draft_model=int4_dir, num_speculative_tokens=3, max_batch_size=None,
                              min_acceptance_rate=0.0))
    assert "linears int4 AWQ g64" in describe_weights(engine.core.executor.draft_model)  # the draft is the int4 copy
    assert run_all(engine, prompts[:8], GREEDY) == plain_greedy[:8]
    stats = engine.stats()
    # int4 rounding flips some argmaxes: drafts are rejected as well as accepted, and exactness holds
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens


@pytest.mark.parametrize("speculative, message", [
    (dict(method="draft", draft_num_layers=30), "draft_num_layers: 30 is not in 1..29"),
    (dict(method="draft", draft_model="TINY"), "vocabulary has 96 tokens, the target's 49152"),
])
def test_bad_drafts_are_refused_at_start(make_engine, tmp_path, speculative, message):
    from tests.support.data.llama_checkpoints import make_checkpoint

    if speculative.get("draft_model") == "TINY":
        make_checkpoint(tmp_path, tie=True, rope_scaling=None)
        speculative = {**speculative, "draft_model": str(tmp_path)}
    with pytest.raises(ValueError, match=message):
        make_engine(speculative)


def test_the_engine_process_loads_the_target_tokenizer_once(make_engine, monkeypatch):
    """fp8 KV calibration text and the draft model's vocabulary check take the tokenizer the engine
    process loaded for its output processor (issue 25 item 4): two loads in all, the target's and
    the draft's own (here the same file), not one more per user."""
    from native_backend.text.tokenizer import Tokenizer

    loads, load = [], Tokenizer._from_directory  # every load ends there (a GGUF's: its unpacked directory)
    monkeypatch.setattr(Tokenizer, "_from_directory", lambda path: loads.append(path) or load(path))
    engine = make_engine(dict(method="draft", draft_model=default_gguf_path(), num_speculative_tokens=2),
                         kv_cache_dtype="fp8_e4m3", kv_scales="calibrate")
    assert engine.core.executor.draft_model is not None and "fp8_e4m3" in engine.describe()
    assert len(loads) == 2, loads
    assert engine.core.executor.tokenizer() is engine.tokenizer
