"""The whole engine on the real default model: greedy output token-identical to transformers.

16 prompts x 48 new tokens run concurrently through continuous batching, with a small per-step
token budget (so prefills are chunked and mixed with decodes) and, in a second run, a KV cache
so small that requests are preempted and recomputed; both must reproduce transformers'
`generate` exactly. Also: stop strings, refusals, abort and prefix-cache reuse.
"""

import os

import pydoc_data.topics
import pytest
import torch
from transformers import AutoModelForCausalLM

from native_backend.config.engine import EngineConfig
from native_backend.core.interface import EngineError, EngineRequest
from native_backend.core.sampling_params import SamplingParams
from native_backend.model.loader import default_gguf_path
from native_backend.process.factory import make_engine_core
from tests.support.checks.engine_checks import assert_abort_frees_every_block

pytestmark = pytest.mark.timeout(1200)  # loads the real model twice (ours and transformers')

NUM_PROMPTS, NEW_TOKENS = 16, 48
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine_factory(tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("tok"))

    def make(**overrides):
        config = EngineConfig.build(path=default_gguf_path(), tokenizer_cache_dir=cache, num_threads=2, **overrides)
        return make_engine_core(config)

    return make


@pytest.fixture(scope="module")
def engine(engine_factory):
    return engine_factory(max_num_batched_tokens=64, max_num_seqs=16)


@pytest.fixture(scope="module")
def prompts(engine):
    text = " ".join(list(pydoc_data.topics.topics.values())[:40])
    ids = engine.tokenizer.encode(text)
    out, offset = [], 0
    for i in range(NUM_PROMPTS):
        length = 20 + 13 * i  # 20 .. 215 tokens: several chunks and block boundaries
        out.append(ids[offset : offset + length])
        offset += length
    return out


@pytest.fixture(scope="module")
def reference(prompts):
    path = default_gguf_path()
    torch.set_num_threads(2)
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                 dtype=torch.float32)
    model.eval()
    outputs = []
    with torch.inference_mode():
        for batch in (prompts[:8], prompts[8:]):  # left-padded batches: positions come from the mask
            width = max(map(len, batch))
            ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            generated = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                       do_sample=False, eos_token_id=None, pad_token_id=0)
            outputs.extend(row[width:].tolist() for row in generated)
    return outputs


def run_all(engine, requests) -> dict[str, list[int]]:
    for request in requests:
        engine.add_request(request)
    tokens = {r.request_id: [] for r in requests}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
    return tokens


def test_concurrent_greedy_output_is_identical_to_transformers(engine, prompts, reference):
    requests = [EngineRequest(f"r{i}", p, GREEDY) for i, p in enumerate(prompts)]
    got = run_all(engine, requests)
    for i in range(NUM_PROMPTS):
        assert got[f"r{i}"] == reference[i], f"prompt {i} diverges"
    assert engine.stats().num_steps > NEW_TOKENS  # they really were batched over many steps
    assert engine.core.scheduler.block_manager.num_free_blocks == engine.core.plan.num_blocks


@pytest.mark.usefixtures("kernel_path")  # once per CPU kernel path (AVX2, AVX-512), forced on the same engine
def test_each_kernel_path_gives_transformers_greedy_output(engine, prompts, reference):
    """The test above runs the path this CPU takes; here a few of its prompts run on each path."""
    picked = (0, 7, 15)  # the shortest, a middle and the longest prompt
    got = run_all(engine, [EngineRequest(f"path{i}", prompts[i], GREEDY) for i in picked])
    assert [got[f"path{i}"] for i in picked] == [reference[i] for i in picked]


def test_preempted_requests_finish_with_the_same_greedy_output(engine_factory, prompts, reference):
    # 40 blocks x 16 tokens: far less than 16 requests need at once, so the scheduler preempts.
    small = engine_factory(max_num_batched_tokens=128, max_num_seqs=16, kv_cache_bytes=40 * 16 * 46080)
    requests = [EngineRequest(f"p{i}", p, GREEDY, priority=i % 3) for i, p in enumerate(prompts)]
    timings = {}
    original_step = small.step

    def step():
        outputs = original_step()
        timings.update({o.request_id: o.timings for o in outputs if o.finished})
        return outputs

    small.step = step
    got = run_all(small, requests)
    assert small.stats().num_preemptions > 0
    assert sum(t["preemptions"] for t in timings.values()) == small.stats().num_preemptions
    for t in timings.values():  # the milestones each request reports for its trace, in order
        assert t["arrived"] <= t["scheduled"] <= t["first_token"] <= t["finished"]
        assert t["prefill_chunks"] >= 1
    for i in range(NUM_PROMPTS):
        assert got[f"p{i}"] == reference[i], f"prompt {i} diverges after preemption"


def test_prefix_cache_hits_do_not_change_the_output(engine, prompts, reference):
    before = engine.stats().prefix_cache_hits
    got = run_all(engine, [EngineRequest("again", prompts[15], GREEDY)])
    assert engine.stats().prefix_cache_hits > before  # the same prompt's full blocks were reused
    assert got["again"] == reference[15]


def test_stop_string_is_cut_and_never_emitted(engine, prompts, reference):
    text = engine.tokenizer.decode(reference[3])
    stop = text[10:16]
    engine.add_request(EngineRequest("stop", prompts[3], SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0,
                                                                      ignore_eos=True, stop=(stop,))))
    pieces, tokens, last = [], [], None
    while engine.has_unfinished():
        for out in engine.step():
            pieces.append(out.new_text)
            tokens += out.new_token_ids
            last = out
    assert last.finish_reason == "stop"
    assert "".join(pieces) == text[: text.index(stop)]
    # The output processor ended it in the core in the step whose token completed the stop string:
    # no token was computed past it, and its blocks are back.
    assert tokens == reference[3][: len(tokens)] and last.num_output_tokens == len(tokens) < NEW_TOKENS
    assert stop in engine.tokenizer.decode(tokens) and stop not in engine.tokenizer.decode(tokens[:-1])
    assert engine.core.scheduler.block_manager.num_free_blocks == engine.core.plan.num_blocks


def test_requests_over_the_context_or_the_cache_are_refused(engine):
    with pytest.raises(EngineError) as info:
        engine.add_request(EngineRequest("long", [1] * 100, SamplingParams(max_tokens=engine.core.max_model_len)))
    assert info.value.kind == "context_length"
    assert str(engine.core.max_model_len) in info.value.message
    with pytest.raises(EngineError) as info:
        engine.add_request(EngineRequest("empty", [], SamplingParams(max_tokens=4)))
    assert info.value.kind == "invalid"
    assert not engine.has_unfinished()


def test_abort_frees_every_block_within_one_step(engine, prompts):
    assert_abort_frees_every_block(engine, prompts[10], GREEDY)


def test_chat_template_answer(engine):
    ids = engine.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    engine.add_request(EngineRequest("paris", ids, SamplingParams(max_tokens=24, temperature=0.0)))
    text, reason = "", None
    while engine.has_unfinished():
        for out in engine.step():
            text += out.new_text
            reason = out.finish_reason or reason
    assert "Paris" in text
    assert reason == "stop"  # ended on the model's own end-of-turn token
    assert "<|im_end|>" not in text
