"""The `tensorrt_llm` backend: a `tensorrt_llm.LLM` in this process, streamed with generate_async.

API names checked against NVIDIA/TensorRT-LLM release 1.2.1 (tensorrt_llm/llmapi/llm.py:
`LLM.__init__`, `generate_async`, `get_stats_async`, `shutdown`; llm_args.py: `KvCacheConfig`,
`TorchLlmArgs` fields, the speculative decoding configs; sampling_params.py: `SamplingParams`).
Newer releases add `priority: float` (0..1, higher first) to generate_async; it is passed only
when the installed version's signature has it, and 1.2.1 relies on our admission queue alone.

    generate ──> PriorityAdmission (by priority) ──> llm.generate_async(streaming=True)
                                                          │ async for output
                                                          └──> outputs[0].text_diff ──> TokenEvent
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import logging
import time
from collections.abc import Mapping

from gateway.backend import GenerationRequest, LoadSnapshot, TokenEvent, Usage
from gateway.errors import BackendError, ContextLengthExceeded, InvalidRequestError
from kvgate_tensorrt_llm import mapping
from kvgate_tensorrt_llm.admission import Aborted, PriorityAdmission
from kvgate_tensorrt_llm.settings import TrtLlmSettings

log = logging.getLogger("kvgate.tensorrt_llm")

SPECULATIVE_CLASSES = {
    "ngram": "NGramDecodingConfig",
    "draft_target": "DraftTargetDecodingConfig",
    "eagle": "EagleDecodingConfig",
    "mtp": "MTPDecodingConfig",
}
LENGTH_HINTS = ("max_seq_len", "max_num_tokens", "context", "too long", "exceed")


class TensorRtLlmBackend:
    def __init__(self, settings: TrtLlmSettings, name: str = "tensorrt_llm"):
        self.settings = settings
        self.name = name
        self.admission = PriorityAdmission(settings.max_in_flight)
        self._trt = None  # the tensorrt_llm module, imported by start()
        self._llm = None
        self._accepts: set[str] = set()  # generate_async's optional arguments in this version
        self._results: dict[str, object] = {}
        self._chat_tokenizer = None
        self._stats: dict | None = None
        self._stats_at = 0.0
        self._poller: asyncio.Task | None = None

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        self._trt = _import_tensorrt_llm(self.name)
        llmapi = importlib.import_module("tensorrt_llm.llmapi")
        kwargs = llm_kwargs(self.settings, llmapi)
        # Building the engine takes minutes; keep the event loop (health checks) responsive.
        self._llm = await asyncio.to_thread(self._trt.LLM, **kwargs)
        self._accepts = set(inspect.signature(self._llm.generate_async).parameters)
        if "priority" not in self._accepts:
            log.info("deployment %s: this TensorRT-LLM has no request priority; kvgate's queue orders "
                     "admission by SLA class", self.name)
        self._poller = asyncio.create_task(self._poll_stats())

    async def stop(self) -> None:
        if self._poller:
            self._poller.cancel()
            await asyncio.gather(self._poller, return_exceptions=True)
        if self._llm is not None:
            llm, self._llm = self._llm, None
            await asyncio.to_thread(llm.shutdown)  # blocks until the executor workers exit

    def load(self) -> LoadSnapshot:
        stats = self._stats if time.monotonic() - self._stats_at <= self.settings.stats_stale_s else None
        queued = self.admission.waiting + (stats["queued"] if stats else 0)
        running = stats["running"] if stats else self.admission.running
        usage = stats["kv_cache_usage"] if stats else 0.0
        extra = {"admitted": float(self.admission.running), "stats_stale": 0.0 if stats else 1.0}
        return LoadSnapshot(queued, running, usage, self.settings.max_in_flight, self._llm is not None, extra)

    async def abort(self, request_id: str) -> None:
        if self.admission.abort(request_id):
            return  # it was still waiting for admission
        result = self._results.get(request_id)
        if result is not None:
            result.abort()

    # -- generation ------------------------------------------------------------------------

    async def generate(self, request: GenerationRequest):
        if self._llm is None:
            raise BackendError(f"The backend '{self.name}' is not started.")
        inputs = await self._inputs(request)
        sampling = self._trt.SamplingParams(**mapping.sampling_kwargs(request.sampling, self.settings.default_max_tokens))
        try:
            await self.admission.acquire(request.request_id, request.priority)
        except Aborted:
            yield TokenEvent(finish_reason="abort", usage=Usage(0, 0))
            return
        result, finished = None, False
        try:
            result = self._submit(inputs, sampling, request)
            self._results[request.request_id] = result
            async for event in self._events(result):
                finished = event.finish_reason is not None
                yield event
        finally:
            self._results.pop(request.request_id, None)
            self.admission.release()
            if result is not None and not finished:
                result.abort()  # the client went away: free the sequence's KV blocks

    async def _inputs(self, request: GenerationRequest):
        if request.messages is None:
            return request.prompt
        return await self._chat_token_ids(request.messages)

    async def _chat_token_ids(self, messages: list[dict]) -> list[int]:
        """The model's own chat template, through transformers (imported only for chat)."""
        if self._chat_tokenizer is None:
            transformers = importlib.import_module("transformers")
            source = self.settings.tokenizer or self.settings.model
            self._chat_tokenizer = await asyncio.to_thread(transformers.AutoTokenizer.from_pretrained, source)
        ids = self._chat_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, Mapping):  # transformers 5 returns a BatchEncoding by default
            ids = ids["input_ids"]
        return list(ids)

    def _submit(self, inputs, sampling, request: GenerationRequest):
        kwargs = {"sampling_params": sampling, "streaming": True}
        if "priority" in self._accepts:
            kwargs["priority"] = mapping.engine_priority(request.priority)
        if "trace_headers" in self._accepts and request.trace_context:
            kwargs["trace_headers"] = dict(request.trace_context)
        try:
            return self._llm.generate_async(inputs, **kwargs)
        except ValueError as exc:  # TensorRT-LLM's _check_arguments: lengths and bad values
            message = str(exc)[:500]
            if any(h in message.lower() for h in LENGTH_HINTS):
                raise ContextLengthExceeded(message, param="max_tokens") from None
            raise InvalidRequestError(message) from None
        except RuntimeError as exc:  # "LLM is shutting down", executor errors
            log.error("deployment %s: generate_async failed: %s", self.name, exc)
            raise BackendError(f"The backend '{self.name}' cannot take requests now.") from None

    async def _events(self, result):
        decode = self._decoder()
        try:
            async for output in result:
                out = output.outputs[0]
                ids = tuple(out.token_ids_diff or ())
                reason = mapping.finish_reason(out.finish_reason)
                usage = Usage(len(output.prompt_token_ids or ()), len(out.token_ids or ())) if reason else None
                lps = mapping.logprobs(getattr(out, "logprobs_diff", None), ids, decode)
                if out.text_diff or ids or reason:
                    yield TokenEvent(out.text_diff or "", ids, lps, reason, usage)
                if reason:
                    return
        except Exception as exc:  # noqa: BLE001 - an engine error mid-stream
            log.error("deployment %s: generation failed: %s: %s", self.name, type(exc).__name__, exc)
            raise BackendError(f"The backend '{self.name}' failed while generating.") from None
        yield TokenEvent(finish_reason="stop", usage=None)  # ended without saying why

    def _decoder(self):
        tokenizer = getattr(self._llm, "tokenizer", None)
        if tokenizer is None:
            return lambda token_id: ""
        return lambda token_id: tokenizer.decode([token_id])

    async def _poll_stats(self) -> None:
        """Iteration stats (enable_iter_perf_stats) -> the latest running count and KV use.
        Each read consumes what it returns, so this is the only reader."""
        while True:
            try:
                async for stat in self._llm.get_stats_async(timeout=2):
                    parsed = mapping.kv_stats(stat)
                    if parsed is not None:
                        self._stats, self._stats_at = parsed, time.monotonic()
            except Exception as exc:  # noqa: BLE001 - stats are advisory
                log.debug("deployment %s: stats read failed: %s", self.name, exc)
            await asyncio.sleep(self.settings.stats_poll_s)


def _import_tensorrt_llm(deployment: str):
    try:
        return importlib.import_module("tensorrt_llm")
    except ModuleNotFoundError as exc:
        if exc.name not in ("tensorrt_llm", None):
            raise  # tensorrt_llm is there but one of its own dependencies is missing
        raise RuntimeError(
            f"deployment '{deployment}' needs the tensorrt_llm package (NVIDIA GPUs); it is not installed"
        ) from None


def llm_kwargs(s: TrtLlmSettings, llmapi) -> dict:
    """`tensorrt_llm.LLM(**kwargs)` for these settings (TorchLlmArgs names, release 1.2.1)."""
    kv = s.kv_cache
    kwargs = {
        "model": s.model,
        "tokenizer": s.tokenizer,
        "tensor_parallel_size": s.tensor_parallel_size,
        "dtype": s.dtype,
        "kv_cache_config": llmapi.KvCacheConfig(
            free_gpu_memory_fraction=kv.free_gpu_memory_fraction,
            enable_block_reuse=kv.enable_block_reuse,
            dtype=kv.dtype,
            tokens_per_block=kv.tokens_per_block,
        ),
        "enable_chunked_prefill": s.enable_chunked_prefill,
        "enable_iter_perf_stats": True,  # get_stats_async yields nothing without it
    }
    if s.max_batch_size is not None:
        kwargs["max_batch_size"] = s.max_batch_size
    if s.max_num_tokens is not None:
        kwargs["max_num_tokens"] = s.max_num_tokens
    if s.speculative is not None:
        cls = getattr(llmapi, SPECULATIVE_CLASSES[s.speculative.method])
        kwargs["speculative_config"] = cls(**(s.speculative.model_extra or {}))
    return kwargs
