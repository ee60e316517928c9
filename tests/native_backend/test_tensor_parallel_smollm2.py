"""Tensor parallelism on the real default model: SmolLM2-135M (fp32; 9 heads, 3 KV heads, so TP 3).

TP 3's logits stay within 1e-4 of TP 1's over several prompts' prefill and 32 decode steps, and
the engine's greedy output at TP 3 is token-identical to TP 1's and to transformers'. Each of the
three ranks holds a third of the split weights and of the KV bytes per token (the norms named as
replicated), as its start-up line says; TP 2 is refused naming TP 3.
"""

from __future__ import annotations

import pytest
import torch

from native_backend.config.engine import EngineConfig
from native_backend.core.interface import EngineRequest
from native_backend.core.sampling_params import SamplingParams
from native_backend.execution.parallel import report
from native_backend.execution.parallel.executor import check_supported
from native_backend.model.loader import default_gguf_path
from native_backend.process.factory import make_engine_core
from native_backend.process.output_processor import OutputProcessor
from tests.support.checks.tensor_parallel_checks import max_difference, run_script, smollm2_prompts, transformers_greedy

pytestmark = pytest.mark.timeout(1800)

NEW_TOKENS = 32
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def engine(cache_dir: str, tp: int) -> OutputProcessor:
    # No prefix caching: the logits script writes KV blocks behind the scheduler's back while idle.
    return make_engine_core(EngineConfig.build(path=default_gguf_path(), tokenizer_cache_dir=cache_dir, num_threads=1,
                                        tensor_parallel_size=tp, kv_cache_bytes=96 << 20,
                                        enable_prefix_caching=False, max_num_batched_tokens=64))


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    torch.set_num_threads(1)
    cache = str(tmp_path_factory.mktemp("tok"))
    one = engine(cache, 1)
    three = engine(cache, 3)
    yield one, three
    three.core.executor.close()


@pytest.fixture(scope="module")
def prompts(engines):
    return smollm2_prompts(engines[0].tokenizer)


@pytest.fixture(scope="module")
def reference(prompts):
    return transformers_greedy(prompts, NEW_TOKENS)


def test_tp3_logits_within_1e4_of_tp1_over_prefill_and_32_decode_steps(engines, prompts):
    one, three = engines
    logits_1, fed = run_script(one.core.executor, prompts, NEW_TOKENS)
    logits_3, _ = run_script(three.core.executor, prompts, NEW_TOKENS, feed=fed)
    assert len(logits_3) == 2 + NEW_TOKENS
    assert max_difference(logits_3, logits_1) < 1e-4


def test_tp3_greedy_output_is_token_identical_to_tp1_and_transformers(engines, prompts, reference):
    for eng in engines:
        for i, p in enumerate(prompts):
            eng.add_request(EngineRequest(f"g{i}", p, GREEDY))
        tokens = {f"g{i}": [] for i in range(len(prompts))}
        while eng.has_unfinished():
            for out in eng.step():
                tokens[out.request_id].extend(out.new_token_ids)
        assert [tokens[f"g{i}"] for i in range(len(prompts))] == reference


def test_each_rank_holds_a_third_of_the_weights_and_kv_bytes_per_token(engines):
    one, three = engines
    single, ranks = one.core.executor.memory_report(), three.core.executor.reports
    assert len(ranks) == 3
    for r in ranks:
        kinds = r["weights_by_kind"]
        assert kinds[report.SPLIT] * 3 == single["weights_by_kind"][report.SPLIT]
        assert set(kinds) == {report.SPLIT, report.NORMS}  # no biases, KV heads split (3 of 3)
        assert r["weights_bytes"] < single["weights_bytes"] / 3 * 1.01
        assert r["kv_bytes_per_token"] * 3 == single["kv_bytes_per_token"] and r["num_kv_heads"] == 1
        assert r["num_blocks"] // 3 == one.core.plan.num_blocks  # the same budget per rank: 3x the tokens (floored)
    line = three.describe()
    for r in ranks:
        assert f"rank {r['rank']}: weights {report.mib(r['weights_bytes'])}" in line
    assert "replicated norms" in line and "3 tensor-parallel ranks" in line


def test_tp2_is_refused_naming_tp3():
    config = EngineConfig.build(path=default_gguf_path(), tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"9 attention heads; 3 KV heads .*valid sizes for this model: 1, 3$"):
        check_supported(config)
