"""The `tensorrt_llm` backend: a `tensorrt_llm.LLM` in this process, streamed with generate_async.

API read from NVIDIA/TensorRT-LLM release 1.2.x (tensorrt_llm/llmapi/llm.py: `LLM.__init__`,
`generate_async`, `get_stats_async`, `shutdown`; llmapi/llm_args.py: `KvCacheConfig`, the
decoding configs; sampling_params.py; executor/result.py: the streamed `RequestOutput`).
Newer releases add `priority: float` (0..1, higher first) to generate_async; it is passed only
when the installed version's signature has it, and 1.2.x relies on our admission queue alone.

    generate ── tokenize / chat template (worker thread) ── EngineLimits (400s, before the GPU)
        └──> PriorityAdmission (by priority) ──> llm.generate_async(ids, streaming=True)
                  └──> async for output: outputs[0].text_diff / token_ids_diff ──> TokenEvent
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import inspect
import logging
from collections.abc import Mapping

from gateway.backend import Backend, GenerationRequest, LoadSnapshot, TokenEvent, Usage
from gateway.errors import APIError, BackendError, ContextLengthExceeded, InvalidRequestError
from kvgate_tensorrt_llm import mapping
from kvgate_tensorrt_llm.admission import Aborted, PriorityAdmission
from kvgate_tensorrt_llm.limits import EngineLimits
from kvgate_tensorrt_llm.settings import TrtLlmSettings
from kvgate_tensorrt_llm.speculative import speculative_config
from kvgate_tensorrt_llm.stats import IterationStats

log = logging.getLogger("kvgate.tensorrt_llm")

LENGTH_HINTS = ("max_seq_len", "max_num_tokens", "context", "too long", "exceed")


class TensorRtLlmBackend(Backend):
    def __init__(self, settings: TrtLlmSettings, name: str = "tensorrt_llm"):
        self.settings = settings
        self.name = name
        self.admission = PriorityAdmission(settings.max_in_flight)
        self._trt = None  # the tensorrt_llm module, imported by start()
        self._llm = None
        self._accepts: set[str] = set()  # generate_async's optional arguments in this version
        self._limits = EngineLimits()
        self._results: dict[str, object] = {}
        self._stats: IterationStats | None = None
        self._poller: asyncio.Task | None = None

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        self._trt = _import_tensorrt_llm(self.name)
        llmapi = importlib.import_module("tensorrt_llm.llmapi")
        kwargs = llm_kwargs(self.settings, llmapi)
        # Building the engine takes minutes; keep the event loop (health checks) responsive.
        self._llm = await asyncio.to_thread(self._trt.LLM, **kwargs)
        self._accepts = set(inspect.signature(self._llm.generate_async).parameters)
        self._limits = EngineLimits.of(self._llm, self.settings)
        if "priority" not in self._accepts:
            log.info("deployment %s: this TensorRT-LLM has no request priority; kvgate's queue orders "
                     "admission by SLA class", self.name)
        s = self.settings
        self._stats = IterationStats(self._llm, s.stats_poll_s, s.stats_stale_s, self.name)
        self._poller = asyncio.create_task(self._stats.run())

    async def stop(self) -> None:
        if self._poller:
            self._poller.cancel()
            await asyncio.gather(self._poller, return_exceptions=True)
        if self._llm is not None:
            llm, self._llm = self._llm, None
            await asyncio.to_thread(llm.shutdown)  # blocks until the executor workers exit

    def load(self) -> LoadSnapshot:
        stats = self._stats.latest() if self._stats else None
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
        ids = await self._prompt_ids(request)
        s = request.sampling
        if s.max_tokens_default:  # the client named none: the server's bound caps our default
            max_tokens = self._limits.output_budget(len(ids), None, min(s.max_tokens, self.settings.default_max_tokens))
        else:
            max_tokens = self._limits.output_budget(len(ids), s.max_tokens, self.settings.default_max_tokens)
        self._limits.check_tokens(ids, s)
        sampling = self._trt.SamplingParams(**mapping.sampling_kwargs(s, max_tokens, self._limits.top_k(s.top_k)))
        try:
            await self.admission.acquire(request.request_id, request.priority)
        except Aborted:
            yield TokenEvent(finish_reason="abort", usage=Usage(0, 0))
            return
        result, finished = None, False
        try:
            result = self._submit(ids, sampling, request)
            self._results[request.request_id] = result
            async with contextlib.aclosing(self._events(result, s.logprobs)) as events:
                async for event in events:  # closed here when the gateway stops early, not by the GC
                    finished = event.finish_reason is not None
                    yield event
        finally:
            self._results.pop(request.request_id, None)
            self.admission.release()
            if result is not None and not finished and not getattr(result, "finished", False):
                result.abort()  # the client went away: free the sequence's KV blocks

    async def _prompt_ids(self, request: GenerationRequest) -> list[int]:
        """Token ids, tokenized or templated in a worker thread: a long prompt must not hold the
        event loop. (generate_async would tokenize text itself, on the caller's thread.)"""
        if isinstance(request.prompt, list):
            return request.prompt
        tokenizer = getattr(self._llm, "tokenizer", None)
        if tokenizer is None:
            raise InvalidRequestError(f"The deployment '{self.name}' has no tokenizer: send token ids.",
                                      param="prompt")
        if request.messages is None:
            return list(await asyncio.to_thread(tokenizer.encode, request.prompt, add_special_tokens=True))
        hf = getattr(tokenizer, "tokenizer", tokenizer)  # TransformersTokenizer wraps the HF one
        ids = await asyncio.to_thread(hf.apply_chat_template, request.messages, add_generation_prompt=True,
                                      tokenize=True)
        if isinstance(ids, Mapping):  # transformers 5 returns a BatchEncoding by default
            ids = ids["input_ids"]
        return list(ids)

    def _submit(self, ids: list[int], sampling, request: GenerationRequest):
        """Called on the event loop's thread, on purpose: the result sets up its asyncio queue only
        when it is created inside a running loop (executor/utils.py `has_event_loop`); created in a
        worker thread, `async for` over it would fail."""
        kwargs = {"sampling_params": sampling, "streaming": True}
        if "priority" in self._accepts:
            kwargs["priority"] = mapping.engine_priority(request.priority)
        if "trace_headers" in self._accepts and request.trace_context:
            kwargs["trace_headers"] = dict(request.trace_context)
        try:
            result = self._llm.generate_async(ids, **kwargs)
        except ValueError as exc:  # llm.py `_check_arguments`: lengths and bad values
            message = str(exc)[:500]
            if any(h in message.lower() for h in LENGTH_HINTS):
                raise ContextLengthExceeded(message, param="messages") from None
            raise InvalidRequestError(message) from None
        except RuntimeError as exc:  # "LLM is shutting down", executor errors
            log.error("deployment %s: generate_async failed: %s", self.name, exc)
            raise BackendError(f"The backend '{self.name}' cannot take requests now.") from None
        if self._stats is not None:
            self._stats.submitted = True
        return result

    async def _events(self, result, k: int | None):
        decode = self._decoder()
        started = False
        try:
            async for output in result:
                # `output` is the same object every step, updated in place: read the diffs now.
                out = output.outputs[0]
                ids = tuple(out.token_ids_diff or ())
                reason = mapping.finish_reason(out.finish_reason)
                usage = Usage(len(output.prompt_token_ids or ()), len(out.token_ids or ())) if reason else None
                lps = mapping.logprobs(out.logprobs_diff, ids, decode, k or 0) if k is not None else ()
                if out.text_diff or ids or reason:
                    started = True
                    yield TokenEvent(out.text_diff or "", ids, lps, reason, usage)
                if reason:
                    return
        except Exception as exc:  # noqa: BLE001 - RequestError (per request) or an engine failure
            raise self._generation_error(exc, started) from None
        yield TokenEvent(finish_reason="stop", usage=None)  # ended without saying why

    def _generation_error(self, exc: Exception, started: bool) -> APIError:
        """A `RequestError` before the first token that names a length or a token id is the
        request's fault: a 400 before the first byte, which the gateway does not count against
        this deployment. Anything else is the engine's."""
        message = str(exc)[:500]
        if not started and type(exc).__name__ == "RequestError":
            if "token id" in message.lower():
                return InvalidRequestError(message, param="prompt")
            if any(h in message.lower() for h in LENGTH_HINTS):
                return ContextLengthExceeded(message, param="max_tokens")
        log.error("deployment %s: generation failed: %s: %s", self.name, type(exc).__name__, message)
        return BackendError(f"The backend '{self.name}' failed while generating.")

    def _decoder(self):
        tokenizer = getattr(self._llm, "tokenizer", None)
        if tokenizer is None:
            return lambda token_id: ""
        return lambda token_id: tokenizer.decode([token_id])


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
    """`tensorrt_llm.LLM(**kwargs)` for these settings (TorchLlmArgs names, release 1.2.x)."""
    kv = s.kv_cache
    kwargs = {
        "model": s.model,
        "tokenizer": s.tokenizer,
        "tensor_parallel_size": s.tensor_parallel_size,
        "dtype": s.dtype,
        "kv_cache_config": llmapi.KvCacheConfig(**kv.model_dump(exclude_none=True)),
        "enable_chunked_prefill": s.enable_chunked_prefill,
        "enable_iter_perf_stats": True,  # get_stats_async yields nothing without it
    }
    for key in ("max_batch_size", "max_num_tokens", "max_seq_len"):
        if getattr(s, key) is not None:
            kwargs[key] = getattr(s, key)
    if s.speculative is not None:
        kwargs["speculative_config"] = speculative_config(s.speculative, llmapi)
    return kwargs
