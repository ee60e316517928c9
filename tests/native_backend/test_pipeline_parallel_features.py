"""Pipeline parallelism with the engine's features, on the 6-layer tiny GQA Llama: at PP 2,
preemption and n-gram speculation keep transformers' greedy tokens, a prompt seen before starts
from the prefix cache; int8 and fp8 (calibrated through every stage) KV caches and int4 AWQ
weights give their PP 1 counterparts' logits and tokens (TP 2 x PP 2 too for int4); pooled vectors
(embeddings) equal PP 1's; a stage that dies or stops fails the step naming its rank, within the
collective timeout, and nothing is left behind."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from native_backend.core.batch import ScheduledChunk, SchedulerOutput
from native_backend.core.engine import LLMEngine
from native_backend.core.interface import EngineRequest
from native_backend.core.sampling_params import SamplingParams
from native_backend.execution.factory import make_executor
from native_backend.execution.parallel.executor import TensorParallelError
from native_backend.tools.quantize import QuantizeOptions, quantize_model
from tests.support.checks.pipeline_checks import (NEW_TOKENS, NUM_LAYERS, PROMPTS, ByteTokenizer, OneAtATime,
                                                  config_for, hf_greedy)
from tests.support.checks.tensor_parallel_checks import (GREEDY, greedy_tokens, max_difference, run_script,
                                                         tiny_gqa_llama)

pytestmark = pytest.mark.timeout(600)

BLOCK_BYTES = 16 * 2 * 3 * 2 * 8 * 4  # a PP 2 stage's block: 16 tokens x K and V x 3 layers x 2 KV heads x 8 x fp32


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.set_num_threads(1)
    return tiny_gqa_llama(tmp_path_factory.mktemp("tiny-gqa-6"), num_layers=NUM_LAYERS)


@pytest.fixture(scope="module")
def reference(checkpoint):
    return hf_greedy(checkpoint, PROMPTS, NEW_TOKENS)


@pytest.fixture(scope="module")
def executors():
    held = OneAtATime()
    yield held
    held.close()


def features(executors, checkpoint):
    """PP 2 with n-gram speculation, prefix caching, and a KV cache of 7 blocks: the prompts and
    their tokens need 8, so someone is preempted."""
    return executors.get("features", checkpoint, pipeline_parallel_size=2, kv_cache_bytes=7 * BLOCK_BYTES,
                         speculative={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})


def test_preemption_and_speculation_keep_the_tokens(executors, checkpoint, reference):
    config, executor = features(executors, checkpoint)
    assert executor.plan.num_blocks == 7
    engine = LLMEngine(config, executor)
    assert greedy_tokens(engine, PROMPTS, NEW_TOKENS) == reference
    stats = engine.stats()
    assert stats.num_preemptions > 0 and stats.spec_decode_num_draft_tokens > 0


def test_a_prompt_seen_before_starts_from_the_prefix_cache(executors, checkpoint, reference):
    config, executor = features(executors, checkpoint)
    engine = LLMEngine(config, executor)
    sampling = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    for request_id in ("first", "again"):
        engine.add_request(EngineRequest(request_id, PROMPTS[2], sampling))
        outputs = [o for _ in range(500) if engine.has_unfinished() for o in engine.step()]
        assert [t for o in outputs for t in o.new_token_ids] == reference[2]
    assert outputs[-1].num_cached_tokens == 32  # two full blocks of the same prompt, from the cache


@pytest.mark.parametrize("name, settings", [
    ("int8", dict(kv_cache_dtype="int8")),
    ("fp8", dict(kv_cache_dtype="fp8_e4m3", kv_scales="calibrate")),
])
def test_quantized_kv_caches_equal_their_single_stage_counterparts(executors, checkpoint, name, settings):
    """fp8: every stage calibrates its own layers on the same pass through the pipeline (rank 0's
    ids), so the scales, and with them the logits, are a single stage's."""
    one = make_executor(config_for(checkpoint, **settings), ByteTokenizer())
    logits_1, fed = run_script(one, PROMPTS[:3], 4)
    config, executor = executors.get(name, checkpoint, ByteTokenizer(), pipeline_parallel_size=2, **settings)
    logits_2, _ = run_script(executor, PROMPTS[:3], 4, feed=fed)
    assert executor.rank.kv_cache.dtype.name == one.kv_cache.dtype.name != "float32"
    assert max_difference(logits_2, logits_1) < 1e-5
    single_tokens = greedy_tokens(LLMEngine(config_for(checkpoint, **settings), one), PROMPTS, NEW_TOKENS)
    assert greedy_tokens(LLMEngine(config, executor), PROMPTS, NEW_TOKENS) == single_tokens


@pytest.fixture(scope="module")
def awq(checkpoint, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("awq") / "int4-g8")  # g8: MLP 112 splits in whole groups at TP 2
    quantize_model(checkpoint, path, QuantizeOptions(method="rtn", group_size=8))
    return path


@pytest.mark.parametrize("name, settings", [("int4 pp2", dict(pipeline_parallel_size=2)),
                                            ("int4 tp2xpp2", dict(tensor_parallel_size=2, pipeline_parallel_size=2))])
def test_int4_weights_give_their_single_stage_tokens(executors, awq, name, settings):
    one = make_executor(config_for(awq))
    assert one.weights.startswith("int4")
    single_tokens = greedy_tokens(LLMEngine(config_for(awq), one), PROMPTS, NEW_TOKENS)
    config, executor = executors.get(name, awq, **settings)
    assert executor.weights == one.weights
    assert greedy_tokens(LLMEngine(config, executor), PROMPTS, NEW_TOKENS) == single_tokens


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_pooled_vectors_equal_a_single_stage(executors, checkpoint, pooling):
    one = LLMEngine(config_for(checkpoint), make_executor(config_for(checkpoint)))
    config, executor = executors.get("pooling", checkpoint, pipeline_parallel_size=2)
    engine = LLMEngine(config, executor)
    vectors = []
    for eng in (one, engine):
        for i, prompt in enumerate(PROMPTS):
            eng.add_request(EngineRequest(f"{pooling}{i}", prompt, pooling=pooling))
        done = {o.request_id: o.embedding for _ in range(500) if eng.has_unfinished() for o in eng.step()}
        vectors.append(torch.tensor([done[f"{pooling}{i}"] for i in range(len(PROMPTS))]))
    assert float((vectors[0] - vectors[1]).abs().max()) < 1e-5


@pytest.mark.parametrize("sig, message", [
    (signal.SIGKILL, r"pipeline-parallel worker died: rank 1 was killed by SIGKILL$"),
    (signal.SIGSTOP, r"pipeline-parallel step failed: .*rank 1 is stopped"),
])
def test_a_stage_that_dies_or_stops_fails_the_step_naming_it_and_nothing_is_left(executors, checkpoint, sig, message):
    executors.close()
    executor = make_executor(config_for(checkpoint, pipeline_parallel_size=3, collective_timeout_s=3))
    processes = [w.process for w in executor.workers]
    try:
        executor.execute(SchedulerOutput([ScheduledChunk("a", PROMPTS[0], 0, [1, 2], True, GREEDY)]))
        os.kill(processes[0].pid, sig)  # rank 1: the middle stage
        started = time.monotonic()
        with pytest.raises(TensorParallelError, match=message):
            executor.execute(SchedulerOutput([ScheduledChunk("a", [5], len(PROMPTS[0]), [1, 2], True, GREEDY)]))
        assert time.monotonic() - started < 30  # the collective timeout, not forever
    finally:
        executor.close()
    assert not any(p.is_alive() for p in processes)
