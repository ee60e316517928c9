"""The one seam of speculative decoding on the execution side: a `Proposer` fills draft slots.

    scheduler (core)                 executor (here)                           runner
    draft slots for a decoding   ──> propose_drafts: the proposer named by ──> runs [last, d1..dn],
    request (as many as the          the chunk writes n <= slots drafts (0:    verifies them, reports
    proposer's count_drafts, <= k),  a plain decode), before a tensor-         DraftCounts per request
    and the proposer that fills      parallel step's deltas are encoded
    them (chunk.proposer)

Proposers (one per speculative method, built by `spec_decode.factory.make_proposer`):
- `ngram.NgramProposer` (method ngram): prompt lookup in the request's own tokens;
- `drafter.DraftModelProposer` (method draft): a draft model's k passes, either the target's own
  first layers over the target's KV (self-speculative) or another checkpoint over a cache of its own.
As in vLLM v1 (v1/spec_decode/), the scheduler never knows how drafts are made, and the runner
never knows who made them: it verifies the tokens it is given (with q when a draft model drew them).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Protocol

import torch

from native_backend.core.batch import SchedulerOutput, ScheduledChunk


@dataclass
class Proposals:
    """One step's drafts: request_id -> tokens (at most the chunk's slots; a request missing has
    none), and request_id -> q (n, vocab), the distributions a draft model drew them from (a
    request missing: one-hot at its drafts, as for n-gram drafts or a greedy request's)."""

    draft_token_ids: dict[str, list[int]]
    draft_probs: dict[str, torch.Tensor] = field(default_factory=dict)


class Proposer(Protocol):
    method: str  # the speculative method it serves: the name chunks give in `proposer`

    def count_drafts(self, request_id: str, tokens: list[int], k: int) -> int:
        """How many of k draft slots it would fill for this request (its tokens so far) now: the
        scheduler reserves only those (core.spec_policy)."""

    def propose(self, chunks: list[ScheduledChunk]) -> Proposals:
        """Drafts for chunks that each have num_spec_tokens slots after one known token."""

    def forget(self, request_ids: list[str]) -> None:
        """Requests that ended or were preempted: drop whatever is kept for them."""


def propose_drafts(proposer: Proposer | None,
                   scheduled: SchedulerOutput) -> tuple[SchedulerOutput, dict[str, torch.Tensor]]:
    """The step with its draft slots filled by the proposer each chunk names, and the draft
    model's q per request. Chunks that carry their own drafts (proposer None) pass unchanged."""
    if proposer is not None:
        proposer.forget(scheduled.finished_request_ids + scheduled.preempted_request_ids)
    asking = [c for c in scheduled.chunks if c.proposer is not None]
    if not asking:
        return scheduled, {}
    method = proposer.method if proposer is not None else None
    for chunk in asking:
        if chunk.proposer != method:
            raise ValueError(f"request {chunk.request_id} asks for drafts from {chunk.proposer!r}; this engine's "
                             f"proposer is {method!r}")
    proposals = proposer.propose(asking)
    drafts = proposals.draft_token_ids
    chunks = [dataclasses.replace(c, draft_token_ids=drafts[c.request_id])
              if c.proposer is not None and c.request_id in drafts else c for c in scheduled.chunks]
    return dataclasses.replace(scheduled, chunks=chunks), proposals.draft_probs
