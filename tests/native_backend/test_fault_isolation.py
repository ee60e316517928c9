"""One request's fault is that request's error: the engine refuses what would break a batched
step when the request arrives, and a request that still fails inside a step (sampling, text)
ends alone while the others in the same batch carry on, token for token as if it were absent.

Runs the real engine on the default model (greedy, so "as if it were absent" is exact).
"""

from dataclasses import replace

import pytest
import torch

from native_backend.config.engine import EngineConfig
from native_backend.core.interface import EngineError, EngineRequest
from native_backend.core.sampling_params import SamplingParams
from native_backend.execution.sampler import FAILED, Sampler, SamplingRow
from native_backend.model.loader import default_gguf_path
from native_backend.process.factory import make_engine_core
from native_backend.process.output_processor import OutputProcessor

pytestmark = pytest.mark.timeout(600)

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    config = EngineConfig.build(path=default_gguf_path(), tokenizer_cache_dir=str(tmp_path_factory.mktemp("tok")),
                                num_threads=2, max_num_seqs=8, max_num_batched_tokens=128, kv_cache_bytes=64 << 20)
    return make_engine_core(config)


def run(engine: OutputProcessor, requests: list[EngineRequest], sabotage=None) -> dict[str, tuple[list[int], object]]:
    """Add the requests, call sabotage(engine) once they are in, step until done:
    request id -> (tokens, error)."""
    for r in requests:
        engine.add_request(r)
    if sabotage is not None:
        sabotage(engine)
    results = {r.request_id: ([], None) for r in requests}
    while engine.has_unfinished():
        for out in engine.step():
            tokens, error = results[out.request_id]
            results[out.request_id] = (tokens + out.new_token_ids, out.error or error)
    assert engine.core.scheduler.block_manager.num_free_blocks == engine.core.scheduler.block_manager.num_blocks
    return results


def prompts(engine, n):
    return [engine.tokenizer.encode(f"Question {i}: what is {i} plus {i}?") for i in range(n)]


@pytest.mark.parametrize("field, value", [
    ("seed", 2**64), ("seed", -(2**63) - 1), ("top_k", 2**40), ("logprobs", 10**6),
    ("temperature", float("nan")), ("top_p", 0.0), ("repetition_penalty", 0.0),
    ("presence_penalty", float("inf")), ("stop_token_ids", tuple(range(5000))), ("max_tokens", 0),
])
def test_values_that_would_break_a_step_are_refused_on_arrival(engine, field, value):
    bad = EngineRequest("bad", [1, 2, 3], replace(GREEDY, **{field: value}))
    with pytest.raises(EngineError) as refused:
        engine.add_request(bad)
    assert refused.value.kind == "invalid" and refused.value.message.startswith(field)
    assert not engine.has_unfinished()


@pytest.mark.parametrize("token", [-1, 49152, 2**40])
def test_prompt_ids_outside_the_vocabulary_are_refused(engine, token):
    with pytest.raises(EngineError, match="outside the vocabulary"):
        engine.add_request(EngineRequest("bad", [1, token, 3], GREEDY))
    assert not engine.has_unfinished()


def test_a_request_whose_sampling_fails_mid_step_ends_alone(engine):
    ids = prompts(engine, 4)
    alone = run(engine, [EngineRequest(f"a{i}", p, GREEDY) for i, p in enumerate(ids) if i != 1])

    def break_sampling(e):  # as if validation had missed a value: the sampler raises on this row
        seq = e.core.scheduler.requests["b1"]
        seq.sampling = replace(seq.sampling, temperature=1.0, seed=2**70)

    batched = run(engine, [EngineRequest(f"b{i}", p, GREEDY) for i, p in enumerate(ids)], break_sampling)
    tokens, error = batched["b1"]
    assert tokens == [] and error is not None and error.kind == "internal"
    assert "sampling failed" in error.message
    for i in (0, 2, 3):
        assert batched[f"b{i}"] == (alone[f"a{i}"][0], None)
    assert engine.stats().num_failed_requests >= 1


def test_a_request_whose_output_processing_fails_ends_alone(engine):
    ids = prompts(engine, 3)
    alone = run(engine, [EngineRequest(f"a{i}", p, GREEDY) for i, p in enumerate(ids)])

    class ExplodingStops:
        def push(self, text):
            raise UnicodeError("a stop matcher that cannot take this text")

    def break_text(e):
        e._texts["b2"].stops = ExplodingStops()

    batched = run(engine, [EngineRequest(f"b{i}", p, GREEDY) for i, p in enumerate(ids)], break_text)
    assert batched["b2"][0] == [] and "output processing failed" in batched["b2"][1].message
    assert batched["b0"] == (alone["a0"][0], None) and batched["b1"] == (alone["a1"][0], None)


def test_sampler_isolates_the_failing_row():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    good = [SamplingRow("s", SamplingParams(temperature=1.0, seed=7)), SamplingRow("g", SamplingParams(temperature=0.0))]
    expected, _ = Sampler()(logits[1:], good)
    errors: dict[str, str] = {}
    bad = SamplingRow("bad", SamplingParams(temperature=1.0, seed=2**70))
    tokens, logprobs = Sampler()(logits, [bad, *good], errors=errors)
    assert tokens == [FAILED, *expected]
    assert list(errors) == ["bad"] and "Overflow" in errors["bad"]
    with pytest.raises(ValueError):  # without an errors dict, a failure still raises
        Sampler()(logits, [bad, *good])
