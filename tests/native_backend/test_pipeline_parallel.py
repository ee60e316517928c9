"""Pipeline parallelism on a tiny random GQA Llama of 6 layers: PP 2, PP 3 (a given uneven
partition 1/2/3) and TP 2 x PP 2 give transformers' greedy tokens, as PP 1 does, through real
worker processes and gloo point-to-point sends, with the engine core keeping P batches in flight;
their logits over a prefill (chunked) and decode script equal PP 1's within 1e-5; each stage holds
only its layers' weights and KV; every stage reports its busy time (the bubble); sizes and
combinations that do not work are refused with the reason. (Features and faults at PP 2:
test_pipeline_parallel_features.py.)"""

from __future__ import annotations

import pytest
import torch

from native_backend.core.engine import LLMEngine
from native_backend.execution.factory import make_executor
from native_backend.execution.parallel.executor import check_supported
from tests.support.checks.pipeline_checks import NEW_TOKENS, NUM_LAYERS, PROMPTS, config_for, hf_greedy
from tests.support.checks.tensor_parallel_checks import greedy_tokens, max_difference, run_script, tiny_gqa_llama

pytestmark = pytest.mark.timeout(600)

LAYOUTS = {"pp2": dict(pipeline_parallel_size=2),
           "pp3": dict(pipeline_parallel_size=3, pipeline_layer_partition=[1, 2, 3]),
           "tp2xpp2": dict(tensor_parallel_size=2, pipeline_parallel_size=2)}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.set_num_threads(1)
    return tiny_gqa_llama(tmp_path_factory.mktemp("tiny-gqa-6"), num_layers=NUM_LAYERS)


@pytest.fixture(scope="module")
def reference(checkpoint):
    """transformers' greedy tokens for every prompt (the reference outside our engine)."""
    return hf_greedy(checkpoint, PROMPTS, NEW_TOKENS)


@pytest.fixture(scope="module")
def single(checkpoint):
    executor = make_executor(config_for(checkpoint))
    logits, fed = run_script(executor, PROMPTS[:3], 4)
    return executor, logits, fed


@pytest.fixture(scope="module", params=list(LAYOUTS))
def pipelined(request, checkpoint):
    config = config_for(checkpoint, **LAYOUTS[request.param])
    executor = make_executor(config)
    yield config, executor
    executor.close()


def engine_with_peak(config, executor) -> tuple[LLMEngine, list[int]]:
    """An engine over `executor`, and a list that records how many steps were in flight after each submit."""
    peaks = []
    submit = executor.submit

    def counting_submit(scheduled):
        submit(scheduled)
        peaks.append(executor.in_flight)

    executor.submit = counting_submit
    return LLMEngine(config, executor), peaks


def test_logits_equal_a_single_stage_over_prefill_and_decode(pipelined, single):
    _, executor = pipelined
    _, logits_1, fed = single
    logits_p, _ = run_script(executor, PROMPTS[:3], 4, feed=fed)
    assert max_difference(logits_p, logits_1) < 1e-5


def test_greedy_tokens_equal_transformers_with_batches_in_flight(pipelined, single, reference):
    config, executor = pipelined
    assert greedy_tokens(LLMEngine(config_for(config.model.path), single[0]), PROMPTS, NEW_TOKENS) == reference
    engine, peaks = engine_with_peak(config, executor)
    assert greedy_tokens(engine, PROMPTS, NEW_TOKENS) == reference
    assert max(peaks) == config.parallel.pipeline_parallel_size  # the stages overlapped
    busy = executor.stage_busy_seconds()
    assert len(busy) == config.parallel.pipeline_parallel_size and min(busy) > 0


def test_each_stage_holds_only_its_layers(pipelined, single):
    config, executor = pipelined
    whole = single[0].memory_report()
    tp, pp = config.parallel.tensor_parallel_size, config.parallel.pipeline_parallel_size
    partition = config.parallel.pipeline_layer_partition or [NUM_LAYERS // pp] * pp
    reports = executor.reports
    assert [r["stage"] for r in reports] == [s for s in range(pp) for _ in range(tp)]
    assert [r["num_layers"] for r in reports] == [n for n in partition for _ in range(tp)]
    for r in reports:  # KV bytes per token in proportion to the stage's layers (and 1/TP of the heads)
        assert r["kv_bytes_per_token"] * NUM_LAYERS * tp == whole["kv_bytes_per_token"] * r["num_layers"]
    layer_bytes = (whole["weights_bytes"] - 2 * 96 * 64 * 4 - 64 * 4) / NUM_LAYERS  # embedding, head, final norm
    for r in reports[:tp]:  # stage 0: the embedding (1/TP of it) and its layers, no head
        assert r["weights_bytes"] * tp == pytest.approx(layer_bytes * r["num_layers"] + 96 * 64 * 4, rel=0.02)
    assert "pipeline parallel" in executor.describe() and f"stage {pp - 1}" in executor.describe()


def test_sizes_and_combinations_that_do_not_work_are_refused(checkpoint):
    with pytest.raises(ValueError, match=r"7 stages cannot split 6 layers .*valid sizes for this model: 1..6"):
        check_supported(config_for(checkpoint, pipeline_parallel_size=7))
    with pytest.raises(ValueError, match=r"partition \[2, 2\]: needs 2 counts of at least 1 layer that add up to "
                                         r"the model's 6 layers"):
        check_supported(config_for(checkpoint, pipeline_parallel_size=2, pipeline_layer_partition=[2, 2]))
    with pytest.raises(ValueError, match=r"pipeline_parallel_size 2 with speculative method 'draft': not supported"):
        check_supported(config_for(checkpoint, pipeline_parallel_size=2,
                                   speculative={"method": "draft", "draft_num_layers": 1}))
    with pytest.raises(ValueError, match=r"pipeline_parallel_size 2 with kv_role 'producer': not supported yet"):
        check_supported(config_for(checkpoint, pipeline_parallel_size=2, kv_role="producer"))
