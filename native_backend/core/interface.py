"""What the engine core takes and gives: the plain data the engine process carries across its pipes.

    EngineRequest ──> EngineCoreProtocol.add_request / abort
                      EngineCoreProtocol.step() ──> [RequestOutput, ...]
                      EngineError: a request refused, or failed alone mid-way
                      EngineCoreProtocol.stats() ──> EngineStats

Inside the engine process the core (core/engine.py) steps in token ids, [CoreOutput, ...]; the
process's output processor turns those into RequestOutputs with text (process/output_processor.py).

Everything here pickles cheaply and imports nothing heavy (no torch), so the gateway side can
use it without loading the engine (process.protocol wraps these in its messages).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal, Protocol

from native_backend.core.batch import SampledLogprobs
from native_backend.core.sampling_params import SamplingParams
from native_backend.core.sequence import FinishReason
from native_backend.text.grammar_spec import GrammarSpec

EngineErrorKind = Literal["invalid", "context_length", "overloaded", "internal"]

# Every id a tokenizer hands out fits in a signed 32-bit int (what the device kernels index with).
MAX_TOKEN_ID = 2**31 - 1

# How a pooling request turns its prompt's final hidden states (after the model's last norm, the
# LM head's input) into one vector: the last token's, or the mean over every token. Either way
# the vector is L2-normalised, as vLLM's embedding models return it.
POOLING_TYPES = ("last", "mean")


@dataclass(frozen=True)
class LoRAStats:
    """An engine's LoRA adapters now (with enable_lora): what vLLM's `vllm:lora_requests_info`
    says (`max_loras`, the adapters of running and of waiting requests), plus every loaded
    adapter's directory (vLLM's /v1/models `root`)."""

    max_loras: int = 0
    adapters: dict[str, str] = field(default_factory=dict)  # name -> adapter directory, loaded in RAM
    running: tuple[str, ...] = ()  # adapters of running requests, sorted
    waiting: tuple[str, ...] = ()  # adapters of waiting requests, sorted


@dataclass(frozen=True)
class EngineStats:
    """A load snapshot of one engine core, sent to the gateway side every stats interval."""

    num_waiting: int = 0  # requests admitted and not yet running
    num_running: int = 0  # requests holding KV blocks
    kv_cache_usage: float = 0.0  # fraction of KV blocks in use, 0..1
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache (since start)
    prefix_cache_hits: int = 0  # of those, tokens found
    num_preemptions: int = 0  # since start
    num_steps: int = 0  # since start
    num_step_tokens: int = 0  # tokens computed by steps (prompt and output), since start
    step_seconds: float = 0.0  # time spent in steps, since start
    num_failed_requests: int = 0  # requests failed alone (their fault) while the engine went on
    block_size: int = 0  # tokens per KV block
    kv_cache_dtype: str = ""  # the KV cache's storage: float32, bfloat16, float16, fp8_e4m3, fp8_e5m2, int8
    weights: str = ""  # the decoder linears' format: float32, bfloat16, int4 AWQ g64, int4 GGUF Q4_1 g32, ...
    cpu_kernels: str = ""  # the C kernels' path that runs: avx512, avx2; "" where none does (CUDA, torch paths)
    prefill: str = ""  # CPU float32: prompt chunks' paths, "matmuls bf16, attention bf16"; "": the model's dtype
    max_model_len: int = 0  # the context length a request may use, prompt + output tokens
    # fp8 KV: K and V values beyond the format's range after scaling, clamped when written, since
    # start (a scale too small for the traffic; 0 for other formats)
    kv_clamped_keys: int = 0
    kv_clamped_values: int = 0
    # Speculative decoding, since start (vLLM's vllm:spec_decode_*): verifications, drafted tokens,
    # accepted drafts, and accepted drafts by position (a tuple: not a float in LoadSnapshot.extra).
    spec_decode_num_speculative_tokens: int = 0  # k of the deployment; 0: speculation is off
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: tuple[int, ...] = ()
    # Constrained decoding, since start: grammars compiled, requests served a grammar compiled
    # before (the cache), constraints refused or past the compile deadline, seconds compiling;
    # and requests waiting for their grammar now.
    grammar_compiles: int = 0
    grammar_cache_hits: int = 0
    grammar_failures: int = 0
    grammar_compile_seconds: float = 0.0
    num_waiting_for_grammar: int = 0
    # Prefill/decode disaggregation (core.kv_connector), since start unless said otherwise. A
    # consumer's reads of producers' blocks: completed, failed (the prompt recomputed), tokens,
    # bytes and seconds they moved, and completed reads per bucket of BYTES_BUCKETS /
    # SECONDS_BUCKETS (the last: beyond them). A producer's: blocks held for consumers now, reads
    # served, reads refused (stale or forged params), holds freed unread (expired, or for room),
    # holds freed unread because the gateway released them (no consumer would read them).
    num_waiting_for_remote_kv: int = 0  # now
    kv_transfers: int = 0
    kv_transfer_failures: int = 0
    kv_transfer_tokens: int = 0
    kv_transfer_bytes: int = 0
    kv_transfer_seconds: float = 0.0
    kv_transfer_bytes_histogram: tuple[int, ...] = ()
    kv_transfer_seconds_histogram: tuple[int, ...] = ()
    kv_transfer_bytes_buckets: tuple[float, ...] = ()  # the histograms' upper bounds
    kv_transfer_seconds_buckets: tuple[float, ...] = ()
    kv_blocks_held: int = 0
    kv_transfers_served: int = 0
    kv_transfers_refused: int = 0
    kv_holds_expired: int = 0
    kv_holds_released: int = 0
    lora: LoRAStats | None = None  # None: the engine runs without enable_lora


@dataclass
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    priority: int = 0  # lower runs earlier
    arrival_time: float = field(default_factory=time.time)  # wall clock (s), set where it arrived
    # W3C trace context (traceparent/tracestate) so the engine's spans join the request's trace.
    trace_context: dict[str, str] = field(default_factory=dict)
    # Constrained decoding: the output must match this (a JSON schema, regex, choice, grammar).
    grammar: GrammarSpec | None = None
    # None: generate. One of POOLING_TYPES: a pooling request (an embedding): its prompt is
    # prefilled like any other, nothing is sampled, its KV is freed at once, and its one output
    # carries the pooled vector (RequestOutput.embedding).
    pooling: str | None = None
    # vLLM's kv_transfer_params (prefill/decode disaggregation, core.kv_connector): do_remote_decode
    # (a prefill whose blocks a decode engine will read) or do_remote_prefill and where to read.
    kv_transfer_params: dict | None = None
    # vLLM's skip_special_tokens: special tokens (<|im_end|>, [TOOL_CALLS]) are left out of the text.
    skip_special_tokens: bool = True
    # Special tokens kept in the text even so, by their text: the markers a tool parser reads
    # (Mistral's [TOOL_CALLS]); those the model's tokenizer has as plain text are text anyway.
    kept_special_tokens: tuple[str, ...] = ()
    # vLLM's cache_salt: mixed into the hash of the prompt's first block, so requests with other
    # salts (another tenant's) never share its cached blocks, nor learn from a hit's speed.
    cache_salt: str | None = None
    # A loaded LoRA adapter's name (native_backend.model.lora): the request runs with it; None: the base.
    lora_name: str | None = None

    def check(self, vocab_size: int) -> None:
        """Refuse (EngineError "invalid") what would fail later inside a batched step, where it
        could take other requests down with it: ids outside the vocabulary, bad sampling values."""
        bad = next((t for t in self.prompt_token_ids if not (type(t) is int and 0 <= t < vocab_size)), None)
        if bad is not None:
            raise EngineError("invalid", f"prompt: token id {bad!r} is outside the vocabulary (0..{vocab_size - 1})")
        if self.cache_salt is not None and not (isinstance(self.cache_salt, str) and self.cache_salt):
            raise EngineError("invalid", f"cache_salt: must be a non-empty string, got {self.cache_salt!r}")
        if self.pooling is not None and self.pooling not in POOLING_TYPES:
            raise EngineError("invalid", f"pooling: must be one of {', '.join(POOLING_TYPES)}, got {self.pooling!r}")
        try:
            self.sampling.check(vocab_size)
        except ValueError as exc:
            raise EngineError("invalid", str(exc)) from None


@dataclass(frozen=True)
class TokenLogprobs:
    """One sampled token's logprobs plus the token strings an API response shows."""

    sampled: SampledLogprobs
    token: str  # decoded text of sampled.token_id
    top_tokens: tuple[str, ...] = ()  # decoded text of each entry of sampled.top, same order


@dataclass
class CoreOutput:
    """What one core step produced for one request, in token ids (RequestOutput less its text)."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    logprobs: list[SampledLogprobs] | None = None  # one per new token when requested
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    timings: dict[str, float] | None = None  # as RequestOutput.timings
    error: EngineError | None = None  # as RequestOutput.error
    embedding: list[float] | None = None  # as RequestOutput.embedding
    kv_transfer_params: dict | None = None  # as RequestOutput.kv_transfer_params

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """What one engine step produced for one request: a delta, not the whole text so far."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finish_reason: FinishReason | None = None  # None while the request is still running
    logprobs: list[TokenLogprobs] | None = None  # one per new token when requested
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_output_tokens: int = 0  # total so far, including new_token_ids
    # On the last output: unix times of "arrived", "scheduled", "first_token", "finished", and the
    # counters "prefill_chunks", "computed_prompt_tokens", "preemptions", "cached_tokens" (for the
    # request's trace).
    timings: dict[str, float] | None = None
    # Set when this request failed alone mid-way (its finish_reason is then "abort"): the engine
    # dropped it and carries on with the others. The client raises it to the consumer.
    error: EngineError | None = None
    # A pooling request's one output: its L2-normalised pooled hidden state (finish_reason "stop").
    embedding: list[float] | None = None
    # On the last output of a prefill for a remote decode: where a consumer reads its blocks.
    kv_transfer_params: dict | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class EngineError(Exception):
    """The engine refused a request (bad input, prompt too long, ...); the engine itself is fine.

    kind says how to answer the client: invalid and context_length are the caller's fault (400),
    overloaded is a retry-later (503), internal is a bug (500).
    """

    def __init__(self, kind: EngineErrorKind, message: str):
        super().__init__(kind, message)  # args stay (kind, message), so it pickles as itself
        self.kind = kind
        self.message = message

    def __str__(self) -> str:
        return f"{self.kind}: {self.message}"


class EngineCoreProtocol(Protocol):
    """What the engine process drives (process.output_processor.OutputProcessor: the core with
    text). Runs in the engine process only, single-threaded."""

    def add_request(self, request: EngineRequest) -> None:
        """Queue a request; raise EngineError to refuse it."""

    def abort(self, request_id: str) -> None:
        """Drop a request and free its resources; unknown or finished ids are a no-op."""

    def step(self) -> list[RequestOutput]:
        """Run one schedule/execute/update step; return the outputs of the requests it advanced."""

    def has_unfinished(self) -> bool:
        """Whether step() has work to do."""

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (its KV-event subscribers are told AllBlocksCleared)."""

    def release_kv(self, engine_id: str, request_id: str) -> None:
        """Free the blocks a producer holds unread for `request_id` under `engine_id` (nobody will
        read them); another engine's id, an unknown request or a read in progress: a no-op."""

    def add_lora(self, name: str, path: str) -> None:
        """Load a LoRA adapter (or replace an idle one); EngineError names what is wrong."""

    def remove_lora(self, name: str) -> None:
        """Unload a LoRA adapter; EngineError when it is not loaded or a request uses it."""

    def stats(self) -> EngineStats:
        """A small, picklable snapshot of load (queue lengths, KV usage, ...) for routing."""
