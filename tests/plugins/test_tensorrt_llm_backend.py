"""The TensorRT-LLM adapter against a stand-in `tensorrt_llm` module.

tensorrt_llm needs NVIDIA GPUs and cannot be installed here. The stand-in below copies the
signatures of release 1.2.1 (LLM(...) refusing unknown arguments like TorchLlmArgs, keyword-only
SamplingParams refusing unknown ones, generate_async without a priority, RequestOutput iterated
with `async for`, `abort()`, get_stats_async) and records every call, so these tests check what
the adapter sends and how it reads the answers, not the engine itself.
"""

from __future__ import annotations

import asyncio
import json
import sys
import types

import pytest

from gateway.backend import GenerationRequest, SamplingParams
from gateway.errors import ContextLengthExceeded
from kvgate_openai import OpenAIBackend
from kvgate_tensorrt_llm import make_tensorrt_llm_backend, make_trtllm_serve_backend

# -- the stand-in ----------------------------------------------------------------------------

TORCH_LLM_ARGS = {  # the TorchLlmArgs fields the adapter may use (release 1.2.1)
    "kv_cache_config", "speculative_config", "max_batch_size", "max_num_tokens",
    "enable_chunked_prefill", "enable_iter_perf_stats",
}
SAMPLING_FIELDS = {
    "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "n",
    "best_of", "logprobs", "repetition_penalty", "presence_penalty", "frequency_penalty",
    "ignore_eos", "detokenize", "return_perf_metrics",
}


class StandInSamplingParams:
    def __init__(self, **kwargs):  # keyword-only, like the real dataclass
        unknown = set(kwargs) - SAMPLING_FIELDS
        if unknown:
            raise TypeError(f"SamplingParams got unexpected keyword arguments {sorted(unknown)}")
        self.max_tokens = 32  # TensorRT-LLM's default
        self.__dict__.update(kwargs)


class Config:
    def __init__(self, **kwargs):
        self.kwargs = kwargs


class Output:
    def __init__(self, text_diff, token_ids_diff, token_ids, finish_reason=None, logprobs_diff=None):
        self.text_diff, self.token_ids_diff, self.token_ids = text_diff, token_ids_diff, token_ids
        self.finish_reason, self.logprobs_diff = finish_reason, logprobs_diff


class StandInResult:
    """A streaming RequestOutput: three words, each released when `gate` allows."""

    def __init__(self, inputs, sampling_params, gate: asyncio.Event):
        self.inputs, self.sampling_params, self.gate = inputs, sampling_params, gate
        self.prompt_token_ids = inputs if isinstance(inputs, list) else list(range(len(inputs.split())))
        self.aborted = False

    def abort(self):
        self.aborted = True

    async def __aiter__(self):
        words = ["alpha", " beta", " gamma"][: self.sampling_params.max_tokens]
        ids = []
        for i, word in enumerate(words):
            await self.gate.wait()
            if self.aborted:
                yield self._out(Output("", [], list(ids), "cancelled"))
                return
            ids.append(100 + i)
            last = i + 1 == len(words)
            lps = [{100 + i: types.SimpleNamespace(logprob=-0.5), 7: -2.0}] if self.sampling_params.__dict__.get("logprobs") is not None else None
            yield self._out(Output(word, [100 + i], list(ids), "length" if last else None, lps))

    def _out(self, output):
        return types.SimpleNamespace(outputs=[output], prompt_token_ids=self.prompt_token_ids)


class StandInLLM:
    instances: list["StandInLLM"] = []

    def __init__(self, model, tokenizer=None, tokenizer_mode="auto", skip_tokenizer_init=False,
                 trust_remote_code=False, tensor_parallel_size=1, dtype="auto", revision=None,
                 tokenizer_revision=None, **kwargs):
        unknown = set(kwargs) - TORCH_LLM_ARGS
        if unknown:
            raise ValueError(f"Unknown LLM arguments {sorted(unknown)}")  # TorchLlmArgs refuses them
        self.args = dict(model=model, tokenizer=tokenizer, tensor_parallel_size=tensor_parallel_size,
                         dtype=dtype, **kwargs)
        self.calls: list[dict] = []
        self.results: list[StandInResult] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.stats: list = []
        self.shut_down = False
        self.tokenizer = types.SimpleNamespace(decode=lambda ids: f"<{ids[0]}>")
        StandInLLM.instances.append(self)

    def generate_async(self, inputs, sampling_params=None, lora_request=None, prompt_adapter_request=None,
                       streaming=False, kv_cache_retention_config=None, disaggregated_params=None,
                       trace_headers=None, _postproc_params=None, scheduling_params=None, cache_salt=None):
        if isinstance(inputs, str) and "too-long" in inputs:
            raise ValueError("The sum of prompt length and max_tokens exceeds max_seq_len (4096)")
        self.calls.append(dict(inputs=inputs, sampling_params=sampling_params, streaming=streaming,
                               trace_headers=trace_headers))
        self.results.append(StandInResult(inputs, sampling_params, self.gate))
        return self.results[-1]

    async def get_stats_async(self, timeout=2):
        while self.stats:
            yield self.stats.pop(0)

    def shutdown(self):
        self.shut_down = True


class NewerLLM(StandInLLM):
    """A later release whose generate_async takes `priority` (0..1, higher first)."""

    def generate_async(self, inputs, sampling_params=None, streaming=False, priority=0.5, **kw):
        result = super().generate_async(inputs, sampling_params, streaming=streaming, **kw)
        self.calls[-1]["priority"] = priority
        return result


@pytest.fixture
def trt(monkeypatch):
    """Install the stand-in as `tensorrt_llm` and `tensorrt_llm.llmapi` for one test."""
    StandInLLM.instances.clear()
    root = types.ModuleType("tensorrt_llm")
    llmapi = types.ModuleType("tensorrt_llm.llmapi")
    root.LLM, root.SamplingParams, root.llmapi = StandInLLM, StandInSamplingParams, llmapi
    for name in ("KvCacheConfig", "NGramDecodingConfig", "DraftTargetDecodingConfig", "EagleDecodingConfig",
                 "MTPDecodingConfig"):
        setattr(llmapi, name, type(name, (Config,), {}))
    monkeypatch.setitem(sys.modules, "tensorrt_llm", root)
    monkeypatch.setitem(sys.modules, "tensorrt_llm.llmapi", llmapi)
    return root


def backend(**settings):
    return make_tensorrt_llm_backend({"model": "/models/llama-awq", **settings}, "trt-0")


def request(rid="r", prompt="hello there", priority=0, **sampling) -> GenerationRequest:
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


# -- LLM construction ------------------------------------------------------------------------

def test_settings_become_llm_arguments(trt):
    b = backend(tokenizer="/tok", tensor_parallel_size=2, dtype="bfloat16", max_batch_size=64,
                max_num_tokens=4096, enable_chunked_prefill=True,
                kv_cache={"free_gpu_memory_fraction": 0.8, "enable_block_reuse": False, "dtype": "fp8",
                          "tokens_per_block": 64},
                speculative={"method": "ngram", "max_draft_len": 4})
    run(b, lambda b: asyncio.sleep(0))
    [llm] = StandInLLM.instances
    args = dict(llm.args)
    kv, spec = args.pop("kv_cache_config"), args.pop("speculative_config")
    assert args == dict(model="/models/llama-awq", tokenizer="/tok", tensor_parallel_size=2, dtype="bfloat16",
                        max_batch_size=64, max_num_tokens=4096, enable_chunked_prefill=True,
                        enable_iter_perf_stats=True)
    assert type(kv).__name__ == "KvCacheConfig"
    assert kv.kwargs == dict(free_gpu_memory_fraction=0.8, enable_block_reuse=False, dtype="fp8", tokens_per_block=64)
    assert type(spec).__name__ == "NGramDecodingConfig" and spec.kwargs == {"max_draft_len": 4}
    assert llm.shut_down


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
    ({"model": "m", "speculative": {"method": "medusa"}}, r"settings\.speculative\.method: "),
    ({"model": "m", "max_in_flight": 0}, r"settings\.max_in_flight: "),
    ({"model": "m", "backend": "tensorrt"}, r"settings\.backend: unknown key"),
])
def test_bad_settings_name_the_field(settings, message):
    with pytest.raises(ValueError, match=message):
        make_tensorrt_llm_backend(settings, "trt-0")


# -- requests --------------------------------------------------------------------------------

def test_sampling_is_mapped_keyword_by_keyword_with_max_tokens_always_set(trt):
    async def go(b):
        await collect(b, request("a", temperature=0.0, top_k=5, seed=3, stop=("x",), stop_token_ids=(2,),
                                 repetition_penalty=1.1, presence_penalty=0.5, ignore_eos=True, logprobs=1))
        await collect(b, request("b"))  # no max_tokens: ours, not TensorRT-LLM's 32
        return StandInLLM.instances[0].calls

    first, second = run(backend(default_max_tokens=2), go)
    assert first["sampling_params"].__dict__ == dict(
        max_tokens=2, temperature=0.0, top_p=1.0, top_k=5, seed=3, stop=["x"], stop_token_ids=[2],
        repetition_penalty=1.1, presence_penalty=0.5, ignore_eos=True, logprobs=1)
    assert second["sampling_params"].__dict__ == dict(max_tokens=2, temperature=1.0, top_p=1.0)
    assert first["streaming"] is True and first["inputs"] == "hello there"


def test_stream_becomes_token_events(trt):
    events = run(backend(), lambda b: collect(b, request(prompt=[5, 6, 7, 8], max_tokens=3, logprobs=1)))
    assert [e.text for e in events] == ["alpha", " beta", " gamma"]
    assert [e.token_ids for e in events] == [(100,), (101,), (102,)]
    assert [e.finish_reason for e in events] == [None, None, "length"]
    assert (events[-1].usage.prompt_tokens, events[-1].usage.completion_tokens) == (4, 3)
    lp = events[0].logprobs[0]
    assert (lp.token, lp.logprob, lp.token_id) == ("<100>", -0.5, 100)
    assert [(t.token, t.logprob) for t in lp.top] == [("<7>", -2.0)]


def test_trace_headers_are_passed_where_the_signature_has_them(trt):
    async def go(b):
        req = request()
        req.trace_context = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
        await collect(b, req)
        return StandInLLM.instances[0].calls[0]

    assert run(backend(), go)["trace_headers"]["traceparent"].startswith("00-0af7")


def test_length_errors_are_context_length_exceeded(trt):
    with pytest.raises(ContextLengthExceeded, match="max_seq_len"):
        run(backend(), lambda b: collect(b, request(prompt="too-long prompt")))


def test_chat_uses_the_tokenizer_chat_template(trt, monkeypatch):
    seen = {}

    class Tokenizer:
        @staticmethod
        def from_pretrained(source):
            seen["source"] = source
            return Tokenizer()

        def apply_chat_template(self, messages, add_generation_prompt, tokenize):
            seen["messages"], seen["add_generation_prompt"] = messages, add_generation_prompt
            return {"input_ids": [1, 2, 3]}

    monkeypatch.setitem(sys.modules, "transformers", types.SimpleNamespace(AutoTokenizer=Tokenizer))
    messages = [{"role": "user", "content": "hi"}]

    async def go(b):
        req = GenerationRequest(request_id="c", model="m", sampling=SamplingParams(max_tokens=1), messages=messages)
        await collect(b, req)
        return StandInLLM.instances[0].calls[0]

    call = run(backend(tokenizer="/tok"), go)
    assert call["inputs"] == [1, 2, 3]
    assert seen == {"source": "/tok", "messages": messages, "add_generation_prompt": True}


# -- admission, abort, load ------------------------------------------------------------------

def test_admission_queue_lets_lower_priority_numbers_in_first(trt):
    async def go(b):
        llm = StandInLLM.instances[0]
        llm.gate.clear()  # the engine holds every request until the gate opens
        first = asyncio.create_task(collect(b, request("first", priority=9)))
        await asyncio.sleep(0.05)
        queued = [asyncio.create_task(collect(b, request(f"r{i}", prompt=f"p{p}", priority=p)))
                  for i, p in enumerate((5, 0, 3, 0))]
        await asyncio.sleep(0.05)
        load = b.load()
        llm.gate.set()
        await asyncio.gather(first, *queued)
        return [c["inputs"] for c in llm.calls], load

    order, load = run(backend(max_in_flight=1), go)
    assert order == ["hello there", "p0", "p0", "p3", "p5"]
    assert (load.waiting, load.running, load.capacity) == (4, 1, 1)


def test_priority_is_passed_only_where_generate_async_takes_it(trt):
    trt.LLM = NewerLLM

    async def go(b):
        await collect(b, request("hi", priority=-1))
        await collect(b, request("lo", priority=2))
        return [c["priority"] for c in StandInLLM.instances[0].calls]

    high, low = run(backend(), go)
    assert 1 > high > 0.5 > low > 0


def test_abort_of_a_running_request_aborts_its_result(trt):
    async def go(b):
        llm = StandInLLM.instances[0]
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
        llm = StandInLLM.instances[0]
        llm.gate.clear()
        running = asyncio.create_task(collect(b, request("running")))
        await asyncio.sleep(0.05)
        queued = asyncio.create_task(collect(b, request("queued", prompt="queued")))
        await asyncio.sleep(0.05)
        await b.abort("queued")
        events = await queued
        llm.gate.set()
        await running
        return events, [c["inputs"] for c in llm.calls]

    events, submitted = run(backend(max_in_flight=1), go)
    assert [e.finish_reason for e in events] == ["abort"]
    assert submitted == ["hello there"]


def test_client_going_away_aborts_the_engine_request(trt):
    async def go(b):
        events = b.generate(request("gone"))
        await anext(events)
        await events.aclose()
        return StandInLLM.instances[0].results[0], b.admission.running

    result, running = run(backend(), go)
    assert result.aborted and running == 0


def test_load_comes_from_iteration_stats(trt):
    stat = {"numActiveRequests": 6, "numQueuedRequests": 2,
            "kvCacheStats": {"maxNumBlocks": 200, "freeNumBlocks": 150, "usedNumBlocks": 50, "tokensPerBlock": 32}}

    async def go(b):
        StandInLLM.instances[0].stats = [json.dumps(stat)]  # 1.2.x yields JSON text
        for _ in range(100):
            if b.load().extra["stats_stale"] == 0.0:
                break
            await asyncio.sleep(0.02)
        return b.load()

    load = run(backend(stats_poll_s=0.02), go)
    assert (load.running, load.waiting, load.kv_cache_usage, load.healthy) == (6, 2, 0.25, True)


# -- remote mode ------------------------------------------------------------------------------

def test_trtllm_serve_is_the_openai_backend_with_trtllm_metrics():
    b = make_trtllm_serve_backend({"base_url": "http://trt:8000/v1"}, "serve-0")
    assert isinstance(b, OpenAIBackend)
    assert b.settings.metrics == "trtllm" and b.settings.scrape_url() == "http://trt:8000/prometheus/metrics"
    assert make_trtllm_serve_backend({"base_url": "http://t/v1", "metrics": "none"}, "s").settings.metrics == "none"
