"""Pooling requests (embeddings) on the real default model, against transformers.

The reference is transformers' `AutoModel` (the base model: `last_hidden_state` is the output of
its final norm, what the LM head reads) on the same GGUF and the same token ids, pooled and
L2-normalised here. Ours runs inside the engine: chunked (a 64-token step budget), batched with
greedy generations, from a cached prefix, and preempted mid-prompt.

Tolerance: float32 weights (the GGUF dequantized, as transformers does) agree to ~3e-7 per
component of the unit vector (measured); TOLERANCE leaves room for other CPUs' kernels. The
default config's int4 linears (quantization: gguf) run the same Q4_1 values in float32
arithmetic of their own: within 1e-6 (measured), held to the same TOLERANCE, with prefill in
float32 (`prefill_matmul: fp32`; where the CPU has bf16 matrix units the default config runs
prompt chunks in bf16: docs/engine/prefill.md).
"""

import pydoc_data.topics
import pytest
import torch

from tests.support.checks.hf_reference import base_model, hidden_states as hf_hidden, max_diff, pooled as reference
from native_backend.config.engine import EngineConfig
from native_backend.core.interface import EngineError, EngineRequest
from native_backend.core.sampling_params import SamplingParams
from native_backend.model.loader import default_gguf_path
from native_backend.process.factory import make_engine_core

pytestmark = pytest.mark.timeout(1200)  # loads the real model (ours and transformers')

TOLERANCE = 1e-5
LENGTHS = (1, 7, 17, 130)  # one token, within a block, across blocks, across 64-token chunks
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine_factory(tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("tok"))

    def make(**overrides):
        settings = dict(max_num_batched_tokens=64, max_num_seqs=16) | overrides
        return make_engine_core(EngineConfig.build(path=default_gguf_path(), tokenizer_cache_dir=cache, num_threads=2,
                                                   **settings))

    return make


@pytest.fixture(scope="module")
def engine(engine_factory):
    return engine_factory()


@pytest.fixture(scope="module")
def token_ids(engine):
    text = " ".join(list(pydoc_data.topics.topics.values())[:10])
    return engine.tokenizer.encode(text)


@pytest.fixture(scope="module")
def prompts(token_ids):
    out, offset = [], 0
    for length in LENGTHS:
        out.append(token_ids[offset : offset + length])
        offset += length
    return out


@pytest.fixture(scope="module")
def hf_model():
    return base_model()


@pytest.fixture(scope="module")
def hidden_states(hf_model, prompts):
    return [hf_hidden(hf_model, p) for p in prompts]


def run_all(engine, requests) -> dict:
    """Every request to its end: request_id -> its final output (generations: all their tokens)."""
    for request in requests:
        engine.add_request(request)
    finals, tokens = {}, {r.request_id: [] for r in requests}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                finals[out.request_id] = out
    return {rid: (out, tokens[rid]) for rid, out in finals.items()}


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_pooled_vectors_match_transformers_while_generations_run(engine, prompts, hidden_states, pooling):
    generations = [EngineRequest(f"gen{i}", p, GREEDY) for i, p in enumerate(prompts[1:3])]
    alone = run_all(engine, generations)
    pooled = [EngineRequest(f"{pooling}{i}", p, pooling=pooling) for i, p in enumerate(prompts)]
    again = [EngineRequest(g.request_id, g.prompt_token_ids, GREEDY) for g in generations]
    mixed = run_all(engine, [again[0], *pooled, again[1]])  # pooling prompts chunked between their steps
    for i, prompt in enumerate(prompts):
        out, new_tokens = mixed[f"{pooling}{i}"]
        assert out.finish_reason == "stop" and out.error is None and new_tokens == []
        assert out.num_prompt_tokens == len(prompt)
        ours = torch.tensor(out.embedding)
        assert ours.shape == (engine.core.model_config.hidden_size,)
        assert abs(float(ours.norm()) - 1.0) < TOLERANCE
        diff = max_diff(ours, reference(hidden_states[i], pooling))
        assert diff < TOLERANCE, f"{pooling} pooling of {len(prompt)} tokens differs by {diff:g}"
    for rid in ("gen0", "gen1"):  # the generations beside them: token for token as without them
        assert mixed[rid][1] == alone[rid][1]
    assert engine.core.scheduler.block_manager.num_free_blocks == engine.core.plan.num_blocks  # every block back


def test_last_pooling_reuses_a_cached_prefix_mean_pooling_does_not(engine, prompts, hidden_states):
    prompt, hidden = prompts[3], hidden_states[3]  # 130 tokens: 8 full blocks to find in the cache
    for pooling, expect_cached in (("last", True), ("mean", False)):
        run_all(engine, [EngineRequest(f"{pooling}-first", prompt, pooling=pooling)])
        again = run_all(engine, [EngineRequest(f"{pooling}-again", prompt, pooling=pooling)])
        out = again[f"{pooling}-again"][0]
        assert (out.num_cached_tokens > 0) is expect_cached, pooling
        diff = max_diff(out.embedding, reference(hidden, pooling))
        assert diff < TOLERANCE


def test_mean_pooling_preempted_mid_prompt_starts_over_and_is_right(engine_factory, token_ids, hf_model):
    # 16 blocks x 16 tokens: a generation holding 7 blocks and growing, and a 180-token prompt
    # (12 blocks) of lower priority that must give its blocks back halfway and prefill again.
    small = engine_factory(kv_cache_bytes=16 * 16 * 46080)
    assert small.core.plan.num_blocks == 16
    prompt = token_ids[:180]
    generation = EngineRequest("gen", token_ids[200:300], SamplingParams(max_tokens=40, temperature=0.0,
                                                                          ignore_eos=True))
    done = run_all(small, [generation, EngineRequest("mean", prompt, priority=1, pooling="mean")])
    out = done["mean"][0]
    assert out.timings["preemptions"] >= 1 and small.stats().num_preemptions >= 1
    assert len(done["gen"][1]) == 40
    expected = reference(hf_hidden(hf_model, prompt), "mean")
    assert max_diff(out.embedding, expected) < TOLERANCE
    assert small.core.scheduler.block_manager.num_free_blocks == small.core.plan.num_blocks


def test_int4_linears_pool_close_to_the_dequantized_reference(engine_factory, prompts, hidden_states):
    """The default config's engine (quantization: gguf): the same vectors, to int4 arithmetic."""
    int4 = engine_factory(quantization="gguf", prefill_matmul="fp32")
    done = run_all(int4, [EngineRequest(f"{p}{i}", prompt, pooling=p) for i, prompt in enumerate(prompts)
                          for p in ("last", "mean")])
    for i in range(len(prompts)):
        for pooling in ("last", "mean"):
            diff = max_diff(done[f"{pooling}{i}"][0].embedding, reference(hidden_states[i], pooling))
            assert diff < TOLERANCE, f"{pooling} pooling of {len(prompts[i])} tokens differs by {diff:g}"


@pytest.mark.parametrize("request_, kind", [
    (EngineRequest("bad-pooling", [1, 2, 3], pooling="max"), "invalid"),
    (EngineRequest("bad-token", [1, 10**7], pooling="last"), "invalid"),
    (EngineRequest("too-long", [1] * 9000, pooling="last"), "context_length"),
])
def test_refused_pooling_requests_leave_the_engine_serving(engine, prompts, hidden_states, request_, kind):
    with pytest.raises(EngineError) as info:
        engine.add_request(request_)
    assert info.value.kind == kind
    done = run_all(engine, [EngineRequest("after", prompts[2], pooling="last")])
    diff = max_diff(done["after"][0].embedding, reference(hidden_states[2], "last"))
    assert diff < TOLERANCE
