"""The native engine behind the gateway's Backend protocol.

The engine core runs in its own process (`native_backend.client.AsyncEngineClient`), so HTTP
serving never waits on a forward pass. This side tokenizes (the model's own chat template),
turns engine outputs into token events, maps engine refusals onto OpenAI errors, and reports
load from the engine's periodic stats. It never imports torch: the engine process loads the
model and unpacks the tokenizer once; this side then reads the unpacked tokenizer.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from gateway.backend import GenerationRequest, LoadSnapshot, TokenEvent, TokenLogprob, TopLogprob, Usage
from gateway.config import format_path
from gateway.errors import APIError, BackendError, ContextLengthExceeded, InvalidRequestError, Overloaded
from native_backend.cache_dir import tokenizer_cache_dir
from native_backend.client import AsyncEngineClient
from native_backend.engine_config import EngineConfig
from native_backend.protocol import EngineDeadError, EngineError, EngineRequest, RequestOutput
from native_backend.sampling_params import SamplingParams as EngineSampling
from native_backend.tokenizer import Tokenizer, default_model_path

log = logging.getLogger("kvgate.native")

ENGINE_FACTORY = "native_backend.engine:make_engine_core"


class NativeSettings(BaseModel):
    """What a deployment's `settings:` may hold for `backend: native`."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field("default", description="GGUF file or HF directory; 'default' is SmolLM2-135M-Instruct.")
    dtype: str = Field("float32", pattern="^(float32|bfloat16|float16)$")
    kv_cache_dtype: str = Field("auto", pattern="^(auto|float32|bfloat16|float16)$")
    device: str = Field("cpu", pattern=r"^(cpu|cuda(:\d+)?)$")
    block_size: int = Field(16, gt=0, le=256, description="Tokens per KV-cache block.")
    max_num_seqs: int = Field(32, gt=0, description="Requests running at once.")
    max_num_batched_tokens: int = Field(512, gt=0, description="Token budget of one step.")
    max_model_len: int | None = Field(None, gt=0, description="Context limit; default: the model's.")
    kv_cache_bytes: int | None = Field(None, gt=0, description="KV-cache budget in bytes.")
    memory_fraction: float = Field(0.9, gt=0, le=1, description="Of GPU memory, when on CUDA.")
    enable_prefix_caching: bool = True
    num_threads: int | None = Field(None, gt=0, description="torch threads in the engine process.")
    cpu_kernels: bool = Field(True, description="On CPU, kvgate's C kernels (decode attention, small-batch "
                              "linears) where they build; false: torch alone.")
    startup_timeout_s: float = Field(600, gt=0, description="Seconds to load the model.")
    # Accepted so deployment tooling can pass them, and refused unless the engine can honour them.
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs one engine shards the model across.")
    quantization: str = Field("none", description="Weight quantization of the checkpoint.")

    @model_validator(mode="after")
    def _supported_so_far(self):
        if self.tensor_parallel_size != 1:
            raise ValueError("tensor_parallel_size: this engine runs on one device so far; use 1")
        if self.quantization != "none":
            raise ValueError(f"quantization: '{self.quantization}' is not supported by this engine yet; use none")
        return self

    def engine_config(self) -> EngineConfig:
        model = default_model_path() if self.model == "default" else self.model
        fields = self.model_dump(exclude={"model", "startup_timeout_s", "tensor_parallel_size", "quantization"})
        return EngineConfig(model=model, tokenizer_cache_dir=str(tokenizer_cache_dir()), **fields)


class NativeBackend:
    def __init__(self, settings: NativeSettings, name: str = "native"):
        self.settings = settings
        self.name = name
        self.config = settings.engine_config()
        self.client = AsyncEngineClient(ENGINE_FACTORY, (self.config,), startup_timeout_s=settings.startup_timeout_s)
        self.tokenizer: Tokenizer | None = None

    async def start(self) -> None:
        if not os.path.exists(self.config.model):
            raise RuntimeError(f"native deployment '{self.name}': model file {self.config.model} does not exist")
        await self.client.start()  # loads the model and unpacks the tokenizer into the cache
        log.info("native deployment '%s': %s", self.name, (self.client.stats() or {}).get("engine"))
        self.tokenizer = await asyncio.to_thread(
            Tokenizer.from_pretrained, self.config.model, cache_dir=self.config.tokenizer_cache_dir
        )

    async def stop(self) -> None:
        await self.client.shutdown()

    async def abort(self, request_id: str) -> None:
        self.client.abort(request_id)

    def load(self) -> LoadSnapshot:
        stats = self.client.stats() or {}
        return LoadSnapshot(
            waiting=int(stats.get("num_waiting", 0)),
            running=int(stats.get("num_running", 0)),
            kv_cache_usage=float(stats.get("kv_cache_usage", 0.0)),
            capacity=self.settings.max_num_seqs,
            healthy=self.client.is_alive,
            extra={k: float(v) for k, v in stats.items() if isinstance(v, (int, float))},
        )

    async def generate(self, request: GenerationRequest):
        engine_request = EngineRequest(
            request_id=request.request_id,
            prompt_token_ids=self._prompt_ids(request),
            sampling=_engine_sampling(request),
            priority=request.priority,
            trace_context=dict(request.trace_context),
        )
        want_logprobs = request.sampling.logprobs is not None
        try:
            async with contextlib.aclosing(self.client.generate(engine_request)) as outputs:
                async for out in outputs:
                    yield _token_event(out, want_logprobs)
        except EngineError as exc:
            raise _api_error(exc) from None
        except EngineDeadError as exc:
            raise BackendError(f"The engine of deployment '{self.name}' is not running: {exc}") from None

    def _prompt_ids(self, request: GenerationRequest) -> list[int]:
        tokenizer = self.tokenizer
        if tokenizer is None:
            raise Overloaded(f"Deployment '{self.name}' is still starting.", retry_after_s=5)
        try:
            if request.messages is not None:
                return tokenizer.apply_chat_template(request.messages)
            if isinstance(request.prompt, list):
                return _checked_token_ids(request.prompt, tokenizer.vocab_size)
            return tokenizer.encode(request.prompt or "")
        except ValueError as exc:
            raise InvalidRequestError(str(exc), param="messages" if request.messages else "prompt") from None


def _checked_token_ids(ids: list[int], vocab_size: int) -> list[int]:
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"token id {bad} is outside the vocabulary (0..{vocab_size - 1})")
    return list(ids)


def _engine_sampling(request: GenerationRequest) -> EngineSampling:
    fields = {f.name for f in dataclasses.fields(EngineSampling)}
    return EngineSampling(**{k: v for k, v in dataclasses.asdict(request.sampling).items() if k in fields})


def _token_event(out: RequestOutput, want_logprobs: bool) -> TokenEvent:
    usage = None
    if out.finished:
        usage = Usage(out.num_prompt_tokens, out.num_output_tokens, out.num_cached_tokens)
    logprobs = ()
    if want_logprobs and out.logprobs:
        logprobs = tuple(
            TokenLogprob(
                token=lp.token, logprob=lp.sampled.logprob, token_id=lp.sampled.token_id,
                top=tuple(TopLogprob(text, logprob, tid) for text, (tid, logprob) in zip(lp.top_tokens, lp.sampled.top)),
            )
            for lp in out.logprobs
        )
    return TokenEvent(
        text=out.new_text, token_ids=tuple(out.new_token_ids), logprobs=logprobs,
        finish_reason=out.finish_reason, usage=usage, timings=out.timings,
    )


def _api_error(exc: EngineError) -> APIError:
    if exc.kind == "context_length":
        return ContextLengthExceeded(exc.message, param="max_tokens")
    if exc.kind == "invalid":
        return InvalidRequestError(exc.message)
    if exc.kind == "overloaded":
        return Overloaded(exc.message, retry_after_s=2)
    return BackendError(exc.message)


def make_native_backend(settings: dict, deployment: str) -> NativeBackend:
    try:
        return NativeBackend(NativeSettings.model_validate(settings), name=deployment)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = f"settings.{format_path(err['loc'])}" if err["loc"] else "settings"
        raise ValueError(f"{where}: {err['msg'].removeprefix('Value error, ')}") from None
