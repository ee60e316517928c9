"""The plain data that crosses the process boundary between the gateway and the engine core.

    gateway process                                    engine process
    AsyncEngineClient ── EngineRequest / abort ──────> engine loop ──> EngineCore.add_request/abort
                      <── [RequestOutput, ...] per step ─            <── EngineCore.step()
                      <── EngineError (request refused)
                      <── stats snapshot (periodic)

Everything here pickles cheaply and imports nothing heavy (no torch), so the gateway side can
use it without loading the engine.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal, Protocol

from native_backend.batch import SampledLogprobs
from native_backend.sampling_params import SamplingParams

FinishReason = Literal["stop", "length", "abort"]
EngineErrorKind = Literal["invalid", "context_length", "overloaded", "internal"]


@dataclass
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    priority: int = 0  # lower runs earlier
    arrival_time: float = field(default_factory=time.time)  # wall clock (s), set where it arrived
    # W3C trace context (traceparent/tracestate) so the engine's spans join the request's trace.
    trace_context: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class TokenLogprobs:
    """One sampled token's logprobs plus the token strings an API response shows."""

    sampled: SampledLogprobs
    token: str  # decoded text of sampled.token_id
    top_tokens: tuple[str, ...] = ()  # decoded text of each entry of sampled.top, same order


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
    # counters "prefill_chunks", "preemptions", "cached_tokens" (for the request's trace).
    timings: dict[str, float] | None = None

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


class EngineDeadError(RuntimeError):
    """The engine process is gone: in-flight requests failed and new ones are refused."""


class EngineStartupError(RuntimeError):
    """The engine process could not be started (its factory raised, it died, or it timed out)."""


class EngineCoreProtocol(Protocol):
    """What the engine process drives. Runs in the engine process only, single-threaded."""

    def add_request(self, request: EngineRequest) -> None:
        """Queue a request; raise EngineError to refuse it."""

    def abort(self, request_id: str) -> None:
        """Drop a request and free its resources; unknown or finished ids are a no-op."""

    def step(self) -> list[RequestOutput]:
        """Run one schedule/execute/update step; return the outputs of the requests it advanced."""

    def has_unfinished(self) -> bool:
        """Whether step() has work to do."""

    def stats(self) -> dict:
        """A small, picklable snapshot of load (queue lengths, KV usage, ...) for routing."""
