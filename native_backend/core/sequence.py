"""One request's state inside the engine: its tokens, where its KV lives, and how far it got.

Plain data plus a few helpers; the scheduler moves a sequence between states and the block
manager owns its `block_table`. No torch here.

    WAITING ──admit──> RUNNING ──finish/abort──> FINISHED
       ^                 │  ^
       │              preempt│ re-admit (re-prefills prompt + output so far)
       │                 v  │
       └──abort──   PREEMPTED ──abort──> FINISHED
       │
       └─admit (remote prefill)─> WAITING_FOR_REMOTE_KV ──loaded──> RUNNING
                                     │ failed: blocks freed, back to WAITING (recompute)
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Literal

from native_backend.core.sampling_params import SamplingParams
from native_backend.core.spec_stats import SpecState
from native_backend.core.kv_params import RemotePrefill
from native_backend.text.grammar import GrammarMatcher

FinishReason = Literal["stop", "length", "abort"]


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # never run yet
    RUNNING = "running"  # holds KV blocks; scheduled every step until it ends or is preempted
    PREEMPTED = "preempted"  # blocks taken back; waits to recompute its KV from its tokens
    FINISHED = "finished"
    # Holds blocks for its prompt's KV, read from a prefill engine off the step loop (kv_connector)
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"


@dataclass(eq=False)  # identity semantics: two requests with equal fields are still two requests
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    priority: int = 0  # lower runs earlier (admission order) and is preempted later
    arrival_time: float = field(default_factory=time.monotonic)
    # None: the scheduler fills in the model's EOS from its config.
    eos_token_id: int | None = None
    # Output-token limit after resolving sampling.max_tokens against the context window;
    # the scheduler sets it in add().
    max_tokens: int | None = None
    # A pooling request (core.interface.POOLING_TYPES): prefill only, never sampled, ended with
    # its pooled vector as soon as the last prompt token has run.
    pooling: str | None = None
    # vLLM's cache_salt: part of the first block's hash (core.block_manager), so of every block's.
    cache_salt: str | None = None
    # The LoRA adapter the request runs with (None: the base model). Part of the first block's
    # hash like cache_salt, so blocks are never shared across adapters (vLLM keys them by adapter).
    lora_name: str | None = None

    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None

    # KV state, owned by the block manager: block_table[i] holds positions [i*bs, (i+1)*bs).
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV is in the cache (a prefix of all tokens)
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at first admission
    # Chained hashes of this sequence's full blocks (derived from tokens only, so they survive
    # preemption and let a resumed request hit its own evicted-but-still-cached blocks).
    block_hashes: list[bytes] = field(default_factory=list)

    num_preemptions: int = 0
    arrival_index: int = 0  # set by the scheduler: breaks arrival_time ties in FIFO order
    spec: SpecState | None = None  # speculative decoding's history of this request (its policy's)
    # Constrained decoding: where the request stands in its grammar. It has seen every output
    # token (preemption keeps them, so it stays valid through recompute); None: unconstrained.
    grammar: GrammarMatcher | None = None
    # Prefill/decode disaggregation (core.kv_connector): a consumer reads its prompt's KV from
    # `remote` before it runs (None once loaded, or when it recomputes); a producer's request
    # `for_remote_decode` keeps its blocks when it ends and answers `kv_transfer_params`.
    remote: RemotePrefill | None = None
    for_remote_decode: bool = False
    kv_transfer_params: dict | None = None

    def __post_init__(self) -> None:
        self.prompt_token_ids = list(self.prompt_token_ids)

    # --- sizes -----------------------------------------------------------------------------

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        """Known tokens whose KV is not in the cache yet (1 for a plain decode)."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def sort_key(self) -> tuple[int, float, int]:
        """Admission order: most important first, then first come first served."""
        return (self.priority, self.arrival_time, self.arrival_index)

    # --- tokens ----------------------------------------------------------------------------

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens at positions [start, end) of prompt + output, without concatenating both."""
        return token_slice(self.prompt_token_ids, self.output_token_ids, start, end)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    # --- limits ----------------------------------------------------------------------------

    def resolve_limits(self, max_model_len: int, default_eos_token_id: int | None) -> None:
        """Fix the output limit and EOS once, so finish checks need no config.

        The context window caps max_tokens, so "reached max_model_len" is "reached max_tokens".
        """
        room = max_model_len - self.num_prompt_tokens
        requested = self.sampling.max_tokens
        self.max_tokens = room if requested is None else min(requested, room)
        if self.eos_token_id is None:
            self.eos_token_id = default_eos_token_id

    def stop_reason_after(self, token_id: int) -> FinishReason | None:
        """Why the sequence ends after `token_id` was appended, or None if it goes on. A
        grammar that is complete ends it ("stop"), even at max_tokens or with ignore_eos."""
        if self.grammar is not None and self.grammar.is_terminated:
            return "stop"
        if token_id in self.sampling.stop_token_ids:
            return "stop"
        if token_id == self.eos_token_id and not self.sampling.ignore_eos:
            return "stop"
        if self.max_tokens is not None and self.num_output_tokens >= self.max_tokens:
            return "length"
        return None


def token_slice(prompt_token_ids: list[int], output_token_ids: list[int], start: int, end: int) -> list[int]:
    """(prompt_token_ids + output_token_ids)[start:end], without concatenating both."""
    num_prompt = len(prompt_token_ids)
    if end <= num_prompt:
        return prompt_token_ids[start:end]
    if start >= num_prompt:
        return output_token_ids[start - num_prompt : end - num_prompt]
    return prompt_token_ids[start:] + output_token_ids[: end - num_prompt]
