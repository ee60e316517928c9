"""The plain data that crosses the scheduler / model-runner seam (no torch here).

The scheduler decides *which tokens of which requests* run this step and where their KV lives;
the runner turns that into tensors, runs the model, and returns sampled tokens. Keeping this
seam as plain data lets the scheduler be tested with hand-made runner outputs.

    sequence positions:  0 .. start_pos-1        start_pos .. start_pos+len(token_ids)-1   then num_spec_tokens
                         [ already in KV cache ]  [ token_ids: computed (and cached) this step ] [ drafts ]
    block_table[i] holds positions [i*block_size, (i+1)*block_size).

Speculative decoding crosses this seam as slots, not tokens: the scheduler reserves num_spec_tokens
KV slots after a decode's token and names the proposer that fills them (`proposer`); the
executor's proposer (execution.spec_decode) writes draft_token_ids (at most that many) before the
step runs; the runner verifies exactly those and reports per request how many drafts it was
given and how many it accepted (`RunnerOutput.drafts`), from which the scheduler rolls back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from native_backend.core.kv_params import KVLoad
from native_backend.core.sampling_params import SamplingParams


@dataclass
class ScheduledChunk:
    """Work for one request in one step: a prefill chunk, or a decode of one (or k+1) tokens."""

    request_id: str
    token_ids: list[int]  # tokens whose KV is computed this step
    start_pos: int  # position of token_ids[0]; equals the number of tokens already cached
    block_table: list[int]  # physical blocks covering positions [0, start_pos + len(token_ids))
    sample: bool  # True when this chunk reaches the end of the known tokens: sample the next one
    sampling: SamplingParams
    # Token history for repetition/presence/frequency penalties (shared lists, not copies).
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    # Trailing positions of token_ids that need logits (1 for a decode or a prompt's last chunk;
    # more to score a text). A chunk's drafts add one row each (`num_logit_rows`).
    num_logits: int = 1
    # Speculative decoding: KV slots reserved after token_ids for drafts (block_table covers them).
    num_spec_tokens: int = 0
    # Where the drafts come from: the name of the execution side's proposer that fills
    # draft_token_ids (the speculative method, "ngram" or "draft"); None: the chunk carries its
    # drafts itself (tests, tools), or has none.
    proposer: str | None = None
    # The drafts the runner verifies (at most num_spec_tokens); it returns the accepted ones plus one.
    draft_token_ids: list[int] = field(default_factory=list)
    # Constrained decoding: the tokens the request's grammar allows next (int32 words, bit t % 32
    # of word t // 32 for token t), for a sampling chunk of a constrained request; else None.
    token_bitmask: np.ndarray | None = None
    # A pooling request's chunk (never sampled): the runner pools its final hidden states, and
    # on the chunk that ends the prompt returns the request's vector (RunnerOutput.pooled).
    pooling: str | None = None
    # The LoRA adapter this request runs with (its name in lora.LoRAManager); None: the base model.
    lora_name: str | None = None

    @property
    def num_logit_rows(self) -> int:
        """Rows of logits this chunk needs when it samples: its known tokens' and one per draft."""
        return self.num_logits + len(self.draft_token_ids)


def step_tokens(chunk: ScheduledChunk) -> list[int]:
    """The tokens a chunk runs: its known tokens, then its drafts (verification)."""
    return chunk.token_ids + chunk.draft_token_ids if chunk.draft_token_ids else chunk.token_ids


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk]
    # Requests that ended (finished or aborted) since the last step: the runner drops their state
    # (e.g. per-request random generators). Preempted requests are *not* listed: they come back.
    finished_request_ids: list[str] = field(default_factory=list)
    preempted_request_ids: list[str] = field(default_factory=list)
    # Remote KV reads to start (kv_connector): requests admitted to wait for a producer's blocks.
    kv_loads: list[KVLoad] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass(frozen=True)
class SampledLogprobs:
    """Raw (pre-temperature, pre-penalty) log-softmax of the sampled token and the top-k."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token_id, logprob), best first


@dataclass(frozen=True)
class DraftCounts:
    """One request's verification in one step: drafts it was given, and of those, accepted."""

    num_proposed: int
    num_accepted: int


NO_DRAFTS = DraftCounts(0, 0)  # a request whose proposer found nothing, or that had no slots


@dataclass
class RunnerOutput:
    # request_id -> tokens sampled this step (one per sampled chunk; more under speculation).
    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # request_id -> one SampledLogprobs per sampled token, only for requests that asked for them.
    logprobs: dict[str, list[SampledLogprobs]] = field(default_factory=dict)
    # request_id -> why its sampling failed: that request ends alone, the batch goes on.
    errors: dict[str, str] = field(default_factory=dict)
    # request_id -> drafts verified and accepted, for every request that verified drafts.
    drafts: dict[str, DraftCounts] = field(default_factory=dict)
    # request_id -> the pooled, L2-normalised vector of a pooling request whose prompt ended this step.
    pooled: dict[str, list[float]] = field(default_factory=dict)
