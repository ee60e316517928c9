"""The engine core: schedule, execute, update. It runs in the engine process, single-threaded.

    add_request ──> Scheduler (waiting) ──schedule()──> SchedulerOutput ──ModelRunner.execute()──>
    RunnerOutput ──Scheduler.update()──> StepResults ──detokenize, stop strings──> RequestOutputs
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace

import torch

from native_backend.detokenizer import IncrementalDetokenizer
from native_backend.engine_config import EngineConfig
from native_backend.kv_cache import KVCache, KVCachePlan, device_memory_bytes, plan_kv_cache, resolve_kv_dtype
from native_backend.loader import load_model
from native_backend.model_runner import ModelRunner
from native_backend.protocol import EngineError, EngineRequest, EngineStats, RequestOutput, TokenLogprobs
from native_backend.scheduler import Scheduler, SchedulerConfig, StepResult
from native_backend.sequence import Sequence
from native_backend.stop import StopStringMatcher
from native_backend.tokenizer import Tokenizer
from native_backend.transforms.kernels import select_kernels

log = logging.getLogger("kvgate.engine")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ACTIVATION_RESERVE_BYTES = 512 << 20  # CUDA: room for activations and the allocator's slack


@dataclass
class _TextState:
    """Per-request output text (incremental detokenization, then stop-string holdback) and the
    request's milestones for its trace."""

    detokenizer: IncrementalDetokenizer
    stops: StopStringMatcher
    want_logprobs: bool
    arrived: float = 0.0  # unix seconds
    scheduled: float | None = None
    first_token: float | None = None
    prefill_chunks: int = 0

    def timings(self, finished: float, preemptions: int, cached_tokens: int) -> dict[str, float]:
        marks = {"arrived": self.arrived, "scheduled": self.scheduled, "first_token": self.first_token,
                 "finished": finished, "prefill_chunks": self.prefill_chunks, "preemptions": preemptions,
                 "cached_tokens": cached_tokens}
        return {k: float(v) for k, v in marks.items() if v is not None}


class LLMEngine:
    def __init__(self, config: EngineConfig):
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.config = config
        self.device = torch.device(config.device)
        started = time.monotonic()
        self.model = load_model(config.model, dtype=DTYPES[config.dtype], device=self.device)
        self.model_config = self.model.config
        self.kernels = select_kernels(self.model, self.device, config.cpu_kernels)
        self.tokenizer = Tokenizer.from_pretrained(config.model, cache_dir=config.tokenizer_cache_dir)
        self.max_model_len = min(config.max_model_len or self.model_config.max_position_embeddings,
                                 self.model_config.max_position_embeddings)
        self.plan = self._plan_kv_cache()
        kv_dtype = config.dtype if config.kv_cache_dtype == "auto" else config.kv_cache_dtype
        self.kv_cache = KVCache.for_model(self.model_config, num_blocks=self.plan.num_blocks,
                                          block_size=config.block_size, dtype=kv_dtype, device=self.device)
        self.runner = ModelRunner(self.model, self.kv_cache, self.device)
        self.eos_token_ids = tuple(dict.fromkeys([*self.model_config.eos_token_ids, *self.tokenizer.eos_token_ids]))
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            block_size=config.block_size,
            num_blocks=self.plan.num_blocks,
            max_model_len=self.max_model_len,
            enable_prefix_caching=config.enable_prefix_caching,
            eos_token_id=self.eos_token_ids[0] if self.eos_token_ids else None,
        ))
        self._texts: dict[str, _TextState] = {}
        self.num_steps = 0
        self.num_step_tokens = 0
        self.step_seconds = 0.0
        self.num_failed_requests = 0  # failed alone (their fault) while the others went on
        log.info("engine ready in %.1f s: %s", time.monotonic() - started, self.describe())

    def describe(self) -> str:
        p = self.plan
        return (f"{self.config.model} on {self.device} ({self.config.dtype}, {self.kernels}); "
                f"KV cache {p.kv_cache_bytes / 2**20:.0f} MiB = "
                f"{p.num_blocks} blocks x {p.block_size} tokens ({p.bytes_per_token} B/token), "
                f"{p.full_context_sequences} sequences at full context {p.max_model_len}")

    def _plan_kv_cache(self) -> KVCachePlan:
        mc, c = self.model_config, self.config
        kv_dtype = resolve_kv_dtype(c.dtype if c.kv_cache_dtype == "auto" else c.kv_cache_dtype)
        common = dict(num_layers=mc.num_layers, num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim,
                      bytes_per_element=kv_dtype.bytes_per_element, block_size=c.block_size,
                      max_model_len=self.max_model_len)
        if c.kv_cache_bytes is not None or self.device.type == "cpu":
            return plan_kv_cache(kv_cache_bytes=c.kv_cache_bytes or c.cpu_kv_cache_bytes, **common)
        weights = sum(t.numel() * t.element_size() for t in self.model.parameters())
        return plan_kv_cache(memory_fraction=c.memory_fraction, total_memory_bytes=device_memory_bytes(self.device),
                             weights_bytes=weights, reserve_bytes=ACTIVATION_RESERVE_BYTES, **common)

    # ------------------------------------------------------------------ requests

    def add_request(self, request: EngineRequest) -> None:
        request.check(self.model_config.vocab_size)  # what would fail inside a batched step
        self._check_lengths(request)
        sampling = request.sampling
        extra_eos = tuple(t for t in self.eos_token_ids[1:] if t not in sampling.stop_token_ids)
        if extra_eos and not sampling.ignore_eos:  # models that end on several ids (SmolLM2: two)
            sampling = replace(sampling, stop_token_ids=tuple(sampling.stop_token_ids) + extra_eos)
        seq = Sequence(request.request_id, request.prompt_token_ids, sampling, request.priority)
        try:
            self.scheduler.add(seq)
        except ValueError as exc:
            raise EngineError("invalid", str(exc)) from None
        self._texts[request.request_id] = _TextState(
            IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids),
            StopStringMatcher(sampling.stop),
            sampling.logprobs is not None,
            arrived=request.arrival_time,
        )

    def _check_lengths(self, request: EngineRequest) -> None:
        prompt = len(request.prompt_token_ids)
        if prompt == 0:
            raise EngineError("invalid", "The prompt is empty.")
        wanted = request.sampling.max_tokens or 1
        if prompt + wanted > self.max_model_len:
            raise EngineError("context_length", (
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{prompt + wanted} tokens ({prompt} in the prompt, {wanted} for the completion)."))
        cache_tokens = self.plan.num_tokens
        if prompt + wanted > cache_tokens:
            raise EngineError("context_length", (
                f"The prompt ({prompt} tokens) plus max_tokens ({wanted}) does not fit in this engine's "
                f"KV cache of {cache_tokens} tokens."))

    def abort(self, request_id: str) -> None:
        self.scheduler.abort(request_id)
        self._texts.pop(request_id, None)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ------------------------------------------------------------------ the loop

    def step(self) -> list[RequestOutput]:
        """Schedule, execute, update; then turn token ids into text deltas."""
        started = time.monotonic()
        scheduled = self.scheduler.schedule()
        self._note_prefill(scheduled)
        runner_output = self.runner.execute(scheduled)
        results = self.scheduler.update(scheduled, runner_output)
        outputs = [self._to_output_or_error(r) for r in results if r.request_id in self._texts]
        self.num_steps += 1
        self.num_step_tokens += scheduled.num_batched_tokens
        self.step_seconds += time.monotonic() - started
        return outputs

    def _note_prefill(self, scheduled) -> None:
        now = time.time()
        for chunk in scheduled.chunks:
            state = self._texts.get(chunk.request_id)
            if state is not None and state.first_token is None:
                state.scheduled = state.scheduled or now
                state.prefill_chunks += 1

    def _to_output_or_error(self, result: StepResult) -> RequestOutput:
        """One request's output; a failure of its own (sampling, text) ends that request alone."""
        try:
            if result.error is None:
                return self._to_output(result)
            message = result.error
        except Exception as exc:  # noqa: BLE001 - the request's tokens/stops are the cause
            message = f"output processing failed: {type(exc).__name__}: {exc}"
        log.warning("request %s failed alone: %s", result.request_id, message)
        self.num_failed_requests += 1
        self.scheduler.finish(result.request_id, "abort")  # no-op if it already ended
        self._texts.pop(result.request_id, None)
        return RequestOutput(result.request_id, [], "", finish_reason="abort",
                             num_prompt_tokens=result.num_prompt_tokens,
                             num_output_tokens=result.num_output_tokens,
                             error=EngineError("internal", message))

    def _to_output(self, result: StepResult) -> RequestOutput:
        state = self._texts[result.request_id]
        if state.first_token is None and result.new_token_ids:
            state.first_token = time.time()
        text, stopped = state.stops.push(state.detokenizer.push(result.new_token_ids))
        finish_reason = result.finish_reason
        if stopped:
            if not result.finished:
                self.scheduler.finish(result.request_id, "stop")
            finish_reason = "stop"
        elif result.finished:
            tail, _ = state.stops.finish(state.detokenizer.flush())
            text += tail
        timings = None
        if finish_reason is not None:
            del self._texts[result.request_id]
            timings = state.timings(time.time(), result.num_preemptions, result.num_cached_tokens)
        return RequestOutput(
            request_id=result.request_id,
            new_token_ids=list(result.new_token_ids),
            new_text=text,
            finish_reason=finish_reason,
            logprobs=self._logprobs(result) if state.want_logprobs else None,
            num_prompt_tokens=result.num_prompt_tokens,
            num_cached_tokens=result.num_cached_tokens,
            num_output_tokens=result.num_output_tokens,
            timings=timings,
        )

    def _logprobs(self, result: StepResult) -> list[TokenLogprobs] | None:
        if not result.logprobs:
            return None
        text = self.tokenizer.token_text
        return [TokenLogprobs(lp, text(lp.token_id), tuple(text(t) for t, _ in lp.top)) for lp in result.logprobs]

    def stats(self) -> EngineStats:
        s = self.scheduler.stats()
        return EngineStats(
            num_waiting=s.num_waiting,
            num_running=s.num_running,
            kv_cache_usage=s.kv_cache_usage,
            kv_blocks_total=self.plan.num_blocks,
            kv_blocks_used=round(s.kv_cache_usage * self.plan.num_blocks),
            prefix_cache_queries=s.prefix_cache_queries,
            prefix_cache_hits=s.prefix_cache_hits,
            num_preemptions=s.num_preemptions,
            num_steps=self.num_steps,
            num_step_tokens=self.num_step_tokens,
            step_seconds=self.step_seconds,
            num_failed_requests=self.num_failed_requests,
        )


def make_engine_core(config: EngineConfig) -> LLMEngine:
    """The factory the engine process calls (by name, so the gateway never imports torch)."""
    return LLMEngine(config)
