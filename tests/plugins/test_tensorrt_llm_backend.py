"""The TensorRT-LLM adapter against the stand-in `tensorrt_llm` (tests/support/fakes/trtllm_standin.py).

tensorrt_llm needs NVIDIA GPUs and cannot be installed here. The stand-in behaves like release
1.2.x's LLM API as its sources define it (each behaviour cites its file): strict config classes,
a RequestOutput mutated in place while streaming, per-request errors raised from the iterator,
get_stats_async as a plain method that warns before the first request. These tests check what
the adapter sends and how it reads the answers, not the engine itself.
"""

from __future__ import annotations

import asyncio
import sys
import threading

import pytest
from tests.support.fakes import trtllm_standin as standin
from tests.support.fakes.trtllm_standin import LLM

from gateway.backend import GenerationRequest, SamplingParams
from gateway.errors import BackendError, ContextLengthExceeded, InvalidRequestError
from kvgate_openai import OpenAIBackend
from kvgate_tensorrt_llm import make_tensorrt_llm_backend, make_trtllm_serve_backend
from kvgate_tensorrt_llm.admission import Aborted, PriorityAdmission


@pytest.fixture
def trt(monkeypatch):
    return standin.install(monkeypatch)


def backend(**settings):
    return make_tensorrt_llm_backend({"model": "/models/llama-awq", **settings}, "trt-0")


def request(rid="r", prompt=(5, 6, 7, 8), priority=0, **sampling) -> GenerationRequest:
    prompt = list(prompt) if isinstance(prompt, tuple) else prompt
    return GenerationRequest(request_id=rid, model="m", sampling=SamplingParams(**sampling), prompt=prompt,
                             priority=priority)


def run(b, coro_fn):
    async def main():
        await b.start()
        try:
            return await coro_fn(b)
        finally:
            await b.stop()
    return asyncio.run(main())


async def collect(b, req):
    return [e async for e in b.generate(req)]


def engine() -> LLM:
    return LLM.instances[0]


# -- LLM construction ------------------------------------------------------------------------

def test_settings_become_llm_arguments(trt):
    b = backend(tokenizer="/tok", tensor_parallel_size=2, dtype="bfloat16", max_batch_size=64,
                max_num_tokens=4096, max_seq_len=8192, enable_chunked_prefill=True,
                kv_cache={"free_gpu_memory_fraction": 0.8, "enable_block_reuse": False, "dtype": "fp8",
                          "tokens_per_block": 64},
                speculative={"method": "ngram", "max_draft_len": 4, "max_matching_ngram_size": 3})
    run(b, lambda b: asyncio.sleep(0))
    args = dict(engine().kwargs)
    kv, spec = args.pop("kv_cache_config"), args.pop("speculative_config")
    assert args == dict(model="/models/llama-awq", tokenizer="/tok", tensor_parallel_size=2, dtype="bfloat16",
                        max_batch_size=64, max_num_tokens=4096, max_seq_len=8192, enable_chunked_prefill=True,
                        enable_iter_perf_stats=True)
    assert isinstance(kv, standin.KvCacheConfig)
    assert kv.model_dump() == dict(free_gpu_memory_fraction=0.8, max_tokens=None, enable_block_reuse=False,
                                   dtype="fp8", tokens_per_block=64)
    assert isinstance(spec, standin.NGramDecodingConfig)
    assert (spec.max_draft_len, spec.max_matching_ngram_size, spec.is_public_pool) == (4, 3, True)
    assert engine().shut_down


@pytest.mark.parametrize("settings,cls,fields", [
    ({"method": "eagle3", "max_draft_len": 3, "speculative_model": "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"},
     standin.EagleDecodingConfig, {"max_draft_len": 3, "speculative_model": "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B",
                                   "eagle3_one_model": True}),
    ({"method": "draft_target", "max_draft_len": 2, "speculative_model": "/models/draft"},
     standin.DraftTargetDecodingConfig, {"max_draft_len": 2, "speculative_model": "/models/draft"}),
    ({"method": "mtp", "num_nextn_predict_layers": 2}, standin.MTPDecodingConfig, {"num_nextn_predict_layers": 2}),
])
def test_each_speculative_method_builds_its_pytorch_backend_class(trt, settings, cls, fields):
    run(backend(speculative=settings), lambda b: asyncio.sleep(0))
    spec = engine().kwargs["speculative_config"]
    assert type(spec) is cls and {k: getattr(spec, k) for k in fields} == fields


def test_missing_package_is_a_clear_start_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt_llm", None)  # import fails as if not installed
    with pytest.raises(RuntimeError, match=r"deployment 'trt-0' needs the tensorrt_llm package \(NVIDIA GPUs\); "
                                           r"it is not installed"):
        asyncio.run(backend().start())


@pytest.mark.parametrize("settings,message", [
    ({}, r"settings\.model: Field required"),
    ({"model": "m", "quant_config": {"quant_algo": "W4A16_AWQ"}}, r"settings\.quant_config: .*pre-quantized checkpoint"),
    ({"model": "m", "kv_cache": {"dtype": "int8"}}, r"settings\.kv_cache\.dtype: "),
    ({"model": "m", "kv_cache": {"free_gpu_memory_fraction": 1.5}}, r"settings\.kv_cache\.free_gpu_memory_fraction: "),
    ({"model": "m", "kv_cache": {"block_reuse": True}}, r"settings\.kv_cache\.block_reuse: unknown key"),
    ({"model": "m", "speculative": {"method": "medusa"}},
     r"settings\.speculative: method 'medusa': Medusa runs on TensorRT-LLM's TensorRT engine backend only"),
    ({"model": "m", "speculative": {"method": "eagle", "max_draft_len": 3}},
     r"settings\.speculative: method 'eagle': the PyTorch backend runs EAGLE-3 only: use method 'eagle3'"),
    ({"model": "m", "speculative": {"max_draft_len": 3}},
     r"settings\.speculative: method missing: choose one of eagle3, ngram, draft_target, mtp"),
    ({"model": "m", "speculative": {"method": "ngram"}}, r"settings\.speculative\.max_draft_len: Field required"),
    ({"model": "m", "speculative": {"method": "ngram", "max_draft_len": 0}},
     r"settings\.speculative\.max_draft_len: Input should be greater than 0"),
    ({"model": "m", "speculative": {"method": "ngram", "max_draft_len": 4, "draft_len": 4}},
     r"settings\.speculative\.draft_len: unknown key"),
    ({"model": "m", "speculative": {"method": "eagle3", "max_draft_len": 3}},
     r"settings\.speculative\.speculative_model: Field required"),
    ({"model": "m", "max_in_flight": 0}, r"settings\.max_in_flight: "),
    ({"model": "m", "backend": "tensorrt"}, r"settings\.backend: unknown key"),
])
def test_bad_settings_name_the_field(settings, message):
    with pytest.raises(ValueError, match=message):
        make_tensorrt_llm_backend(settings, "trt-0")


def test_what_the_settings_accept_tensorrt_llm_accepts_too():
    """Each section our settings validate builds the stand-in's strict class without an error."""
    from kvgate_tensorrt_llm.speculative import speculative_config

    llmapi = standin
    for spec in ({"method": "ngram", "max_draft_len": 1}, {"method": "mtp"},
                 {"method": "eagle3", "max_draft_len": 1, "speculative_model": "e"},
                 {"method": "draft_target", "max_draft_len": 1, "speculative_model": "d", "max_concurrency": 8}):
        settings = make_tensorrt_llm_backend({"model": "m", "speculative": spec}, "t").settings
        speculative_config(settings.speculative, llmapi)
        standin.KvCacheConfig(**settings.kv_cache.model_dump(exclude_none=True))


def test_check_config_reports_speculative_mistakes_without_a_gpu(tmp_path, capsys):
    from gateway.cli import main

    bad = tmp_path / "trt.yaml"
    bad.write_text(
        "models:\n  - name: m\n    deployments:\n      - name: d\n        backend: tensorrt_llm\n"
        "        settings:\n          model: /models/llama\n"
        "          speculative: {method: ngram, max_draft_len: 4, max_ngram_size: 3}\n"
    )
    assert main(["check-config", str(bad)]) == 1
    assert "models[0].deployments[0].settings.speculative.max_ngram_size: unknown key" in capsys.readouterr().err


# -- requests --------------------------------------------------------------------------------

def test_sampling_is_mapped_keyword_by_keyword_with_max_tokens_always_set(trt):
    async def go(b):
        await collect(b, request("a", temperature=0.0, top_k=5, seed=3, stop=("x",), stop_token_ids=(2,),
                                 repetition_penalty=1.1, presence_penalty=0.5, ignore_eos=True, logprobs=1))
        await collect(b, request("b"))  # no max_tokens: ours, not TensorRT-LLM's 32
        return engine().calls

    first, second = run(backend(default_max_tokens=2), go)
    assert first["sampling_params"].sent() == dict(
        max_tokens=2, temperature=0.0, top_p=1.0, top_k=5, seed=3, stop=["x"], stop_token_ids=[2],
        repetition_penalty=1.1, presence_penalty=0.5, ignore_eos=True, logprobs=1)
    assert second["sampling_params"].sent() == dict(max_tokens=2, temperature=1.0, top_p=1.0)
    assert first["streaming"] is True and first["inputs"] == [5, 6, 7, 8]


def test_stream_reads_the_diffs_of_the_one_mutated_output(trt):
    events = run(backend(), lambda b: collect(b, request(max_tokens=3)))
    assert [e.text for e in events] == [" w100", " w101", " w102"]
    assert [e.token_ids for e in events] == [(100,), (101,), (102,)]
    assert [e.finish_reason for e in events] == [None, None, "length"]
    assert (events[-1].usage.prompt_tokens, events[-1].usage.completion_tokens) == (4, 3)
    result = engine().results[0]
    assert result.outputs[0].token_ids == [100, 101, 102]  # one object, grown in place


def test_logprobs_give_the_k_most_likely_tokens_as_openai_does(trt):
    events = run(backend(), lambda b: collect(b, request(max_tokens=3, logprobs=2)))
    lps = [e.logprobs[0] for e in events]
    assert [(lp.token_id, lp.logprob) for lp in lps] == [(100, -0.5), (101, -1.0), (102, -10.0)]
    # First choice: listed among its 2; second: likewise; outside the top 2: not listed, and the
    # engine's extra entry for the sampled token is not passed on as a third alternative.
    assert [[t.token_id for t in lp.top] for lp in lps] == [[100, 7], [7, 101], [7, 8]]
    assert lps[1].top[0].token == " w7" and lps[1].top[0].logprob == -0.5


def test_logprobs_without_alternatives_still_ask_the_engine_for_one(trt):
    async def go(b):
        events = await collect(b, request(max_tokens=1, logprobs=0))
        return events, engine().calls[0]["sampling_params"].logprobs

    events, sent = run(backend(), go)
    assert sent == 1  # logprobs=0 would return none: the PyTorch backend tests bool(logprobs)
    assert [(lp.token_id, lp.logprob, lp.top) for lp in events[0].logprobs] == [(100, -0.5, ())]


def test_text_prompts_and_chat_templates_are_tokenized_off_the_event_loop(trt):
    messages = [{"role": "user", "content": "hi"}]

    async def go(b):
        loop_thread = threading.get_ident()
        await collect(b, request("t", prompt="hello there world", max_tokens=1))
        chat = GenerationRequest(request_id="c", model="m", sampling=SamplingParams(max_tokens=1), messages=messages)
        await collect(b, chat)
        return loop_thread

    loop_thread = run(backend(), go)
    llm, hf = engine(), engine().tokenizer.tokenizer
    text_call, chat_call = llm.calls
    assert text_call["inputs"] == [1] + hf.encode("hello there world", add_special_tokens=False)
    assert chat_call["inputs"] == [1, 7, 8, 9] and hf.chat_calls == [(messages, True)]
    assert len(hf.encode_threads) == 3 and loop_thread not in hf.encode_threads[:2]
    # generate_async itself runs on the loop's thread: its result's asyncio queue needs the loop.
    assert {c["thread"] for c in llm.calls} == {loop_thread}


def test_trace_headers_are_passed_where_the_signature_has_them(trt):
    async def go(b):
        req = request()
        req.trace_context = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
        await collect(b, req)
        return engine().calls[0]

    assert run(backend(), go)["trace_headers"]["traceparent"].startswith("00-0af7")


# -- refusals before the GPU -----------------------------------------------------------------

def test_prompt_plus_max_tokens_over_max_seq_len_is_a_400_before_submission(trt):
    async def go(b):
        with pytest.raises(ContextLengthExceeded, match="maximum context length is 2048 tokens") as info:
            await collect(b, request(prompt=(5,) * 2040, max_tokens=10))
        return info.value, engine().calls

    err, calls = run(backend(), go)
    assert (err.status, err.code, err.param) == (400, "context_length_exceeded", "max_tokens")
    assert calls == []


def test_without_max_tokens_the_output_is_capped_by_what_the_context_has_left(trt):
    async def go(b):
        await collect(b, request(prompt=(5,) * 2044))  # 2044 tokens of a 2048 context
        return engine().calls[0]["sampling_params"].max_tokens

    assert run(backend(default_max_tokens=1024), go) == 4


def test_prompt_over_max_num_tokens_is_a_400_before_submission(trt):
    async def go(b):
        with pytest.raises(ContextLengthExceeded, match="at most 16 in one prompt"):
            await collect(b, request(prompt=(5,) * 18, max_tokens=1))
        return engine().calls

    assert run(backend(max_num_tokens=16), go) == []


@pytest.mark.parametrize("sampling,param", [
    ({"prompt": (5, 1000)}, "prompt"),
    ({"prompt": (5, -1)}, "prompt"),
    ({"stop_token_ids": (5000,)}, "stop_token_ids"),
    ({"seed": -1}, "seed"),
    ({"seed": 2**64}, "seed"),
])
def test_ids_and_seeds_the_engine_cannot_take_are_400s_before_submission(trt, sampling, param):
    prompt = sampling.pop("prompt", (5, 6))

    async def go(b):
        with pytest.raises(InvalidRequestError) as info:
            await collect(b, request(prompt=prompt, max_tokens=1, **sampling))
        return info.value, engine().calls

    err, calls = run(backend(), go)
    assert (err.status, err.param, calls) == (400, param, [])


def test_a_top_k_beyond_the_vocabulary_means_no_top_k_filter(trt):
    async def go(b):
        await collect(b, request("a", max_tokens=1, top_k=1000))
        await collect(b, request("b", max_tokens=1, top_k=2**40))
        await collect(b, request("c", max_tokens=1, top_k=999))
        return [c["sampling_params"].top_k for c in engine().calls]

    assert run(backend(), go) == [None, None, 999]


# -- errors from the engine ------------------------------------------------------------------

def test_engine_length_errors_from_the_iterator_are_context_length_exceeded(trt):
    """Limits we could not know (a smaller max_seq_len inside the engine) still end as a 400."""
    async def go(b):
        b._limits = type(b._limits)()  # as if the engine had not told us its limits
        with pytest.raises(ContextLengthExceeded, match="exceeds max_seq_len"):
            await collect(b, request(prompt=(5,) * 2040, max_tokens=10))
        return engine().results[0].aborted

    assert run(backend(), go) is False


def test_engine_token_id_errors_from_the_iterator_are_invalid_requests(trt):
    async def go(b):
        b._limits = type(b._limits)()
        with pytest.raises(InvalidRequestError, match="Token ID out of range") as info:
            await collect(b, request(prompt=(5, 4000), max_tokens=1))
        return info.value

    assert run(backend(), go).param == "prompt"


def test_synchronous_length_errors_of_generate_async_are_context_length_exceeded(trt):
    async def go(b):
        b._limits = type(b._limits)()
        with pytest.raises(ContextLengthExceeded, match="max_num_tokens"):
            await collect(b, request(prompt=(5,) * 18, max_tokens=1))

    run(backend(max_num_tokens=16), go)


def test_other_engine_errors_are_backend_errors(trt, monkeypatch):
    monkeypatch.setattr(LLM, "_request_error", lambda self, ids, params: "CUDA error: an illegal memory access")

    async def go(b):
        with pytest.raises(BackendError, match="failed while generating"):
            await collect(b, request(max_tokens=1))
        return b.admission.running

    assert run(backend(), go) == 0


# -- admission, abort, load ------------------------------------------------------------------

def test_admission_queue_lets_lower_priority_numbers_in_first(trt):
    async def go(b):
        llm = engine()
        llm.gate.clear()  # the engine holds every request until the gate opens
        first = asyncio.create_task(collect(b, request("first", priority=9)))
        await asyncio.sleep(0.05)
        queued = [asyncio.create_task(collect(b, request(f"r{i}", prompt=(p + 2,), priority=p)))
                  for i, p in enumerate((5, 0, 3, 0))]
        await asyncio.sleep(0.05)
        load = b.load()
        llm.gate.set()
        await asyncio.gather(first, *queued)
        return [c["inputs"] for c in llm.calls], load

    order, load = run(backend(max_in_flight=1), go)
    assert order == [[5, 6, 7, 8], [2], [2], [5], [7]]
    assert (load.waiting, load.running, load.capacity) == (4, 1, 1)


def test_a_new_arrival_never_waits_behind_aborted_waiters_while_there_is_room():
    async def go():
        gate = PriorityAdmission(limit=1)
        await gate.acquire("running", 0)
        waiter = asyncio.create_task(gate.acquire("aborted", 0))
        await asyncio.sleep(0)
        assert gate.waiting == 1
        assert gate.abort("aborted")
        gate.release()  # room now, while the aborted waiter has not yet run its clean-up
        assert gate.waiting == 0
        await asyncio.wait_for(gate.acquire("new", 5), timeout=1)  # enters at once
        with pytest.raises(Aborted):
            await waiter
        return gate.running

    assert asyncio.run(go()) == 1


def test_a_cancelled_waiter_does_not_hold_a_slot_or_the_queue():
    async def go():
        gate = PriorityAdmission(limit=1)
        await gate.acquire("a", 0)
        cancelled = asyncio.create_task(gate.acquire("b", 0))
        behind = asyncio.create_task(gate.acquire("c", 1))
        await asyncio.sleep(0)
        cancelled.cancel()
        await asyncio.gather(cancelled, return_exceptions=True)
        gate.release()
        await asyncio.wait_for(behind, timeout=1)
        return gate.running, gate.waiting

    assert asyncio.run(go()) == (1, 0)


def test_priority_is_passed_only_where_generate_async_takes_it(monkeypatch):
    class NewerLLM(LLM):
        """A later release whose generate_async takes `priority` (0..1, higher first)."""

        def generate_async(self, inputs, sampling_params=None, streaming=False, priority=0.5, **kw):
            result = super().generate_async(inputs, sampling_params, streaming=streaming, **kw)
            self.calls[-1]["priority"] = priority
            return result

    standin.install(monkeypatch, NewerLLM)

    async def go(b):
        await collect(b, request("hi", priority=-1, max_tokens=1))
        await collect(b, request("lo", priority=2, max_tokens=1))
        return [c["priority"] for c in engine().calls]

    high, low = run(backend(), go)
    assert 1 > high > 0.5 > low > 0


def test_abort_of_a_running_request_aborts_its_result(trt):
    async def go(b):
        llm = engine()
        llm.gate.clear()
        task = asyncio.create_task(collect(b, request("x")))
        await asyncio.sleep(0.05)
        await b.abort("x")
        llm.gate.set()
        return await task, llm.results[0]

    events, result = run(backend(), go)
    assert result.aborted and events[-1].finish_reason == "abort"


def test_abort_of_a_queued_request_never_reaches_the_engine(trt):
    async def go(b):
        llm = engine()
        llm.gate.clear()
        running = asyncio.create_task(collect(b, request("running")))
        await asyncio.sleep(0.05)
        queued = asyncio.create_task(collect(b, request("queued", prompt=(9,))))
        await asyncio.sleep(0.05)
        await b.abort("queued")
        events = await queued
        llm.gate.set()
        await running
        return events, [c["inputs"] for c in llm.calls]

    events, submitted = run(backend(max_in_flight=1), go)
    assert [e.finish_reason for e in events] == ["abort"]
    assert submitted == [[5, 6, 7, 8]]


def test_client_going_away_aborts_the_engine_request(trt):
    async def go(b):
        events = b.generate(request("gone"))
        await anext(events)
        await events.aclose()
        return engine().results[0], b.admission.running

    result, running = run(backend(), go)
    assert result.aborted and running == 0


def test_load_comes_from_iteration_stats(trt):
    stat = {"numActiveRequests": 6, "numQueuedRequests": 2,
            "kvCacheStats": {"maxNumBlocks": 200, "freeNumBlocks": 150, "usedNumBlocks": 50, "tokensPerBlock": 32}}

    async def go(b):
        await collect(b, request(max_tokens=1))  # the stats exist once a request was submitted
        engine().push_stats(stat)
        for _ in range(100):
            if b.load().extra["stats_stale"] == 0.0:
                break
            await asyncio.sleep(0.02)
        return b.load()

    load = run(backend(stats_poll_s=0.02), go)
    assert (load.running, load.waiting, load.kv_cache_usage, load.healthy) == (6, 2, 0.25, True)


def test_an_idle_deployment_does_not_poll_stats_into_warnings(trt):
    async def go(b):
        await asyncio.sleep(0.2)  # ten poll intervals with no request yet
        return engine().stats_warnings

    assert run(backend(stats_poll_s=0.02), go) == 0


# -- remote mode ------------------------------------------------------------------------------

def test_trtllm_serve_is_the_openai_backend_with_trtllm_metrics():
    b = make_trtllm_serve_backend({"base_url": "http://trt:8000/v1"}, "serve-0")
    assert isinstance(b, OpenAIBackend)
    assert b.settings.metrics == "trtllm" and b.settings.scrape_url() == "http://trt:8000/prometheus/metrics"
    assert make_trtllm_serve_backend({"base_url": "http://t/v1", "metrics": "none"}, "s").settings.metrics == "none"
