"""A stand-in for the `tensorrt_llm` package (LLM API, release 1.2.x, PyTorch backend).

tensorrt_llm needs NVIDIA GPUs and cannot be installed here, so the adapter's tests run against
this module. Every behaviour below is the real one as NVIDIA/TensorRT-LLM's sources define it;
each names the file it was read from (paths inside that repository). It records what it is sent,
so tests check what the adapter does with the real API's quirks, not the engine itself.

    LLM(...)                         llmapi/llm.py BaseLLM.__init__: unknown kwargs -> ValueError
    KvCacheConfig, *DecodingConfig   llmapi/llm_args.py: StrictBaseModel, extra fields and
                                     out-of-range values -> pydantic ValidationError
    generate_async(...)              llmapi/llm.py: a RequestOutput created on the caller's loop
    async for output in result       executor/result.py: the same object, mutated in place
    get_stats_async(timeout)         llmapi/llm.py -> executor/executor.py aget_stats
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional, Union

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, NonNegativeInt, PositiveInt, model_validator

# -- config classes (llmapi/llm_args.py) -----------------------------------------------------


class StrictBaseModel(BaseModel):
    """llm_args.py: every LLM API config class forbids unknown fields."""

    model_config = ConfigDict(extra="forbid")


class KvCacheConfig(StrictBaseModel):
    """llm_args.py KvCacheConfig (the fields an LLM user sets; the rest keep their defaults)."""

    enable_block_reuse: bool = True
    max_tokens: Optional[int] = None
    free_gpu_memory_fraction: Optional[float] = Field(default=0.9, ge=0, le=1)
    dtype: str = "auto"  # a plain str upstream, read by the PyTorch backend only
    tokens_per_block: int = 32


class DecodingBaseConfig(StrictBaseModel):
    """llm_args.py DecodingBaseConfig; `speculative_model` also accepts the older name
    `speculative_model_dir` (AliasChoices upstream)."""

    max_draft_len: Optional[NonNegativeInt] = None
    speculative_model: Optional[Union[str, Path]] = Field(
        default=None, validation_alias=AliasChoices("speculative_model", "speculative_model_dir"))
    max_concurrency: Optional[NonNegativeInt] = None


class NGramDecodingConfig(DecodingBaseConfig):
    decoding_type: Literal["NGram"] = "NGram"
    max_matching_ngram_size: PositiveInt = 2
    is_keep_all: bool = True
    is_use_oldest: bool = True
    is_public_pool: bool = True

    @model_validator(mode="after")
    def _draft_len(self):  # validate_ngram_config
        if not self.max_draft_len:
            raise ValueError("max_draft_len must be > 0 for NGram")
        return self


class DraftTargetDecodingConfig(DecodingBaseConfig):
    decoding_type: Literal["Draft_Target"] = "Draft_Target"

    @model_validator(mode="after")
    def _draft(self):  # validate_draft_target_config
        if not self.max_draft_len:
            raise ValueError("max_draft_len must be > 0 for DraftTarget")
        if self.speculative_model is None:
            raise ValueError("speculative_model must be specified for DraftTarget")
        return self


class EagleDecodingConfig(DecodingBaseConfig):
    """On the PyTorch backend this is EAGLE-3 (its spec_dec_mode is EAGLE3 or EAGLE3_ONE_MODEL)."""

    decoding_type: Literal["Eagle"] = "Eagle"
    eagle3_one_model: Optional[bool] = True

    @model_validator(mode="after")
    def _eagle(self):  # validate_eagle_config, validate_speculative_model
        if not self.max_draft_len:
            raise ValueError("max_draft_len must be > 0 for Eagle")
        if self.speculative_model is None:
            raise ValueError("Draft model must be provided for EAGLE")
        return self


class MTPDecodingConfig(DecodingBaseConfig):
    decoding_type: Literal["MTP"] = "MTP"
    num_nextn_predict_layers: PositiveInt = 1
    use_relaxed_acceptance_for_thinking: bool = False
    relaxed_topk: int = 1
    relaxed_delta: float = 0.0


class MedusaDecodingConfig(DecodingBaseConfig):
    """Exists, but `supports_backend` is False for "pytorch": refused when the LLM is built."""

    decoding_type: Literal["Medusa"] = "Medusa"


class TorchLlmArgs(StrictBaseModel):
    """The TorchLlmArgs fields the adapter may pass (llm_args.py BaseLlmArgs / TorchLlmArgs)."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    model: Union[str, Path]
    tokenizer: Optional[Union[str, Path]] = None
    tensor_parallel_size: int = 1
    dtype: str = "auto"
    kv_cache_config: KvCacheConfig = Field(default_factory=KvCacheConfig)
    enable_chunked_prefill: bool = False
    speculative_config: Optional[Union[NGramDecodingConfig, DraftTargetDecodingConfig, EagleDecodingConfig,
                                       MTPDecodingConfig, MedusaDecodingConfig]] = None
    max_batch_size: Optional[int] = 2048
    max_seq_len: Optional[int] = None
    max_num_tokens: Optional[int] = 8192
    enable_iter_perf_stats: bool = False

    @model_validator(mode="after")
    def _backend(self):
        spec = self.speculative_config
        if isinstance(spec, MedusaDecodingConfig):
            raise ValueError("Medusa speculative decoding is not supported by the pytorch backend")
        return self


# -- sampling (sampling_params.py) -----------------------------------------------------------


@dataclass
class SamplingParams:
    """sampling_params.py: a keyword-only dataclass (unknown keywords -> TypeError); max_tokens
    defaults to 32; `_get_output_config` asks for logprobs only when `bool(logprobs)`."""

    max_tokens: int = 32
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    seed: Optional[int] = None
    stop: Optional[Union[str, list]] = None
    stop_token_ids: Optional[list] = None
    n: int = 1
    best_of: Optional[int] = None
    logprobs: Optional[int] = None
    repetition_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    ignore_eos: bool = False
    detokenize: bool = True
    return_perf_metrics: bool = False

    def __post_init__(self):
        self.best_of = self.best_of or self.n
        if self.best_of < self.n:
            raise ValueError(f"best_of ({self.best_of}) cannot be less than n ({self.n})")

    def sent(self) -> dict:
        """The fields a caller set away from their defaults (for assertions)."""
        defaults = SamplingParams()
        return {k: v for k, v in vars(self).items() if v != getattr(defaults, k) and k != "best_of"}


class RequestError(RuntimeError):
    """executor/utils.py: a per-request failure, raised from the result's iterator."""


# -- results (executor/result.py) ------------------------------------------------------------


@dataclass
class Logprob:
    logprob: float
    rank: Optional[int] = None


@dataclass
class CompletionOutput:
    """The diffs are views over what was added since the last response (result.py)."""

    index: int
    text: str = ""
    token_ids: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    finish_reason: Optional[str] = None
    _last_text_len: int = 0
    _last_token_ids_len: int = 0
    _last_logprobs_len: int = 0

    @property
    def text_diff(self) -> str:
        return self.text[self._last_text_len:]

    @property
    def token_ids_diff(self) -> list:
        return self.token_ids[self._last_token_ids_len:]

    @property
    def logprobs_diff(self) -> list:
        return self.logprobs[self._last_logprobs_len:]


class RequestOutput:
    """A streaming result. `async for` yields *this same object* after each response, its
    outputs[0] updated in place (result.py `__anext__` returns self). The asyncio queue exists only
    if an event loop was running when it was created (`has_event_loop()` in executor/utils.py);
    otherwise async iteration fails its assertion."""

    def __init__(self, llm: "LLM", prompt_token_ids: list, params: SamplingParams, error: str | None):
        self._llm, self.prompt_token_ids, self.sampling_params = llm, prompt_token_ids, params
        self.outputs = [CompletionOutput(0)]
        self.has_aqueue = _has_event_loop()
        self._error = error
        self._done = False
        self.aborted = False

    @property
    def finished(self) -> bool:
        return self._done

    def abort(self) -> None:
        self.aborted = True

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self._done:
            raise StopAsyncIteration
        assert self.has_aqueue, ("The asyncio event loop was not present during initialization, "
                                 "so async operations are not available.")
        await self._llm.gate.wait()
        await asyncio.sleep(0)
        if self._error is not None:
            self._done = True  # the background error handler raises it (executor.py)
            raise RequestError(self._error)
        self._step()
        return self

    def _step(self) -> None:
        out = self.outputs[0]
        out._last_text_len, out._last_token_ids_len = len(out.text), len(out.token_ids)
        out._last_logprobs_len = len(out.logprobs)
        if self.aborted:
            out.finish_reason, self._done = "cancelled", True
            return
        i = len(out.token_ids)
        token = self._llm.script[i % len(self._llm.script)]
        out.token_ids.append(token)
        out.text += self._llm.tokenizer.decode([token])
        if self.sampling_params.logprobs:  # bool(): 0 asks for nothing
            out.logprobs.append(self._llm.logprob_entry(token, self.sampling_params.logprobs))
        if len(out.token_ids) >= self.sampling_params.max_tokens:
            out.finish_reason, self._done = "length", True


def _has_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


class IterationResult:
    """result.py IterationResult: `__anext__` waits up to the timeout for the next stats entry
    and returns it already decoded (`json.loads`); on a timeout it marks itself done and stops, and
    stays done until the next submission calls `mark_undone()`."""

    def __init__(self):
        self.queue: asyncio.Queue = asyncio.Queue()
        self.timeout = 2.0
        self.done = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.done:
            raise StopAsyncIteration
        try:
            data = await asyncio.wait_for(self.queue.get(), self.timeout)
        except asyncio.TimeoutError:
            self.done = True
            raise StopAsyncIteration from None
        return json.loads(data)


async def _empty_async_iterable():
    if False:  # noqa: SIM108 - an async generator that yields nothing (executor.py)
        yield


# -- the LLM (llmapi/llm.py) -----------------------------------------------------------------


class HFTokenizer:
    """What TransformersTokenizer wraps: one word per token id ("w<id>"), 1000 ids."""

    def __init__(self, vocab: int = 1000):
        self.vocab = vocab
        self.encode_threads: list[int] = []

    def __len__(self) -> int:
        return self.vocab

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.encode_threads.append(threading.get_ident())
        time.sleep(0.01)  # a real tokenizer holds the thread for a while
        return [1] * add_special_tokens + [(sum(map(ord, w)) % (self.vocab - 2)) + 2 for w in text.split()]

    def decode(self, ids: list[int], **kw) -> str:
        return "".join(f" w{i}" for i in ids)

    def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=True):
        self.encode_threads.append(threading.get_ident())
        self.chat_calls = getattr(self, "chat_calls", []) + [(messages, add_generation_prompt)]
        return {"input_ids": [1, 7, 8, 9]}  # transformers 5 returns a BatchEncoding


class TransformersTokenizer:
    """tokenizer.py TransformersTokenizer: `.tokenizer` is the Hugging Face one."""

    def __init__(self, hf: HFTokenizer):
        self.tokenizer = hf

    def encode(self, text: str, *args, **kwargs) -> list[int]:
        return self.tokenizer.encode(text, *args, **kwargs)

    def decode(self, ids: list[int], *args, **kwargs) -> str:
        return self.tokenizer.decode(ids, *args, **kwargs)


class LLM:
    instances: list["LLM"] = []
    GENERATE_ASYNC = ("inputs", "sampling_params", "lora_request", "prompt_adapter_request", "streaming",
                      "kv_cache_retention_config", "disaggregated_params", "_postproc_params",
                      "scheduling_params", "cache_salt", "trace_headers")

    def __init__(self, model, tokenizer=None, tokenizer_mode="auto", skip_tokenizer_init=False,
                 trust_remote_code=False, tensor_parallel_size=1, dtype="auto", revision=None,
                 tokenizer_revision=None, **kwargs):
        for key in kwargs:  # BaseLLM.__init__ checks the kwargs against the args class first
            if key not in TorchLlmArgs.model_fields:
                raise ValueError(f"{self.__class__.__name__} got invalid argument: {key}")
        self.args = TorchLlmArgs(model=model, tokenizer=tokenizer, tensor_parallel_size=tensor_parallel_size,
                                 dtype=dtype, **kwargs)
        self.kwargs = dict(model=model, tokenizer=tokenizer, tensor_parallel_size=tensor_parallel_size,
                           dtype=dtype, **kwargs)
        # The PyTorch backend takes max_seq_len from the checkpoint when it is not given.
        if self.args.max_seq_len is None:
            self.args.max_seq_len = 2048
        self.tokenizer = TransformersTokenizer(HFTokenizer())
        self.calls: list[dict] = []
        self.results: list[RequestOutput] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.script = [100, 101, 102]  # the tokens every request generates, in turn
        # The model's ranking at each step: 100 is its first choice, 101 its second, 102 not in the top 5.
        self.ranking = {100: [100, 7, 8, 9, 10], 101: [7, 101, 8, 9, 10]}
        self.stats_result: IterationResult | None = None
        self.stats_warnings = 0
        self.shut_down = False
        LLM.instances.append(self)

    def generate_async(self, inputs, sampling_params=None, lora_request=None, prompt_adapter_request=None,
                       streaming=False, kv_cache_retention_config=None, disaggregated_params=None,
                       _postproc_params=None, scheduling_params=None, cache_salt=None, trace_headers=None):
        if self.shut_down:
            raise RuntimeError("LLM is shutting down")
        params = sampling_params or SamplingParams()
        ids = self.tokenizer.encode(inputs) if isinstance(inputs, str) else list(inputs)
        self._check_arguments(len(ids))
        self._mark_stats_undone()
        self.calls.append(dict(inputs=inputs, sampling_params=params, streaming=streaming,
                               trace_headers=trace_headers, thread=threading.get_ident()))
        result = RequestOutput(self, ids, params, self._request_error(ids, params))
        self.results.append(result)
        return result

    def _check_arguments(self, prompt_len: int) -> None:
        """llm.py `_check_arguments`: on the PyTorch backend the only synchronous length check is
        the prompt against max_num_tokens, and only without chunked prefill."""
        a = self.args
        if not a.enable_chunked_prefill and a.max_num_tokens and prompt_len > a.max_num_tokens:
            raise ValueError(f"The sum of prompt length ({prompt_len}), query length (0) should not exceed "
                             f"max_num_tokens ({a.max_num_tokens})")

    def _request_error(self, ids: list, params: SamplingParams) -> str | None:
        """What the executor reports for this request through the iterator (RequestError).

        - token ids: `_validate_request` in _torch/pyexecutor/py_executor.py raises "Token ID out
          of range" and `_fetch_and_activate_new_requests` turns it into this request's error
          (`_handle_errors`);
        - prompt + max_tokens over max_seq_len: nothing checks it synchronously on the PyTorch
          backend (llm.py `_check_arguments` returns early), so the executor's per-request error
          is what reports it (as issue 16 reads it);
        - seed / top_k: `SamplingConfig` is a C++ binding (uint64 seed, int32 top_k); the request is
          converted in the executor worker, so a bad value fails that request there.
        """
        vocab = len(self.tokenizer.tokenizer)
        if any(not 0 <= t < vocab for t in ids):
            return "Token ID out of range"
        if len(ids) + params.max_tokens > self.args.max_seq_len:
            return f"prompt length ({len(ids)}) + max_tokens ({params.max_tokens}) exceeds max_seq_len ({self.args.max_seq_len})"
        if params.seed is not None and not 0 <= params.seed < 2**64:
            return "incompatible function arguments: SamplingConfig(random_seed)"
        if params.top_k is not None and not 0 <= params.top_k < 2**31:
            return "incompatible function arguments: SamplingConfig(top_k)"
        return None

    def logprob_entry(self, token: int, k: int) -> dict:
        """The PyTorch sampler's top-k for one position, ranked, plus the sampled token when it is
        not among them (result.py `compute_logprobs` does the same on the TRT backend)."""
        ranked = self.ranking.get(token, [7, 8, 9, 10, 11])
        entry = {t: Logprob(-0.5 * r, r) for r, t in enumerate(ranked[:k], start=1)}
        if token not in entry:
            rank = ranked.index(token) + 1 if token in ranked else 20
            entry[token] = Logprob(-0.5 * rank, rank)
        return entry

    # -- stats ---------------------------------------------------------------------------

    def get_stats_async(self, timeout: Optional[float] = 2):
        """A plain method (not async). Before the first request there is no IterationResult:
        it prints a warning and returns an empty async iterable, every call (executor.py)."""
        if self.stats_result is None:
            self.stats_warnings += 1
            print("Iteration statistics are not available yet. ...", file=sys.stderr)
            return _empty_async_iterable()
        self.stats_result.timeout = timeout
        return self.stats_result

    def push_stats(self, stat: dict) -> None:
        """What the executor's stats thread does each iteration: a JSON string into the queue."""
        self.stats_result.queue.put_nowait(json.dumps(stat))

    def _mark_stats_undone(self) -> None:  # executor.py `_maybe_initialize_iteration_results`
        if self.stats_result is None:
            self.stats_result = IterationResult()
        else:
            self.stats_result.done = False

    def shutdown(self) -> None:
        time.sleep(0.01)  # blocks until the executor's workers exit
        self.shut_down = True


def install(monkeypatch, llm_class=LLM) -> types.ModuleType:
    """Install this stand-in as `tensorrt_llm` and `tensorrt_llm.llmapi` for one test."""
    LLM.instances.clear()
    root = types.ModuleType("tensorrt_llm")
    llmapi = types.ModuleType("tensorrt_llm.llmapi")
    root.LLM, root.SamplingParams, root.llmapi = llm_class, SamplingParams, llmapi
    for cls in (KvCacheConfig, NGramDecodingConfig, DraftTargetDecodingConfig, EagleDecodingConfig,
                MTPDecodingConfig, MedusaDecodingConfig):
        setattr(llmapi, cls.__name__, cls)
    llmapi.RequestError = RequestError
    monkeypatch.setitem(sys.modules, "tensorrt_llm", root)
    monkeypatch.setitem(sys.modules, "tensorrt_llm.llmapi", llmapi)
    return root
