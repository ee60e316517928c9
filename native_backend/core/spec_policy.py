"""Which decoding requests speculate this step, and with how many tokens (pure Python).

    decoding requests > max_batch_size    nobody speculates: a full batch has no spare compute,
                                          and k extra rows per request would only slow it down
    request paused                        no drafts (it counts down its pause)
    ngram                                 the drafts found (0..k); no match: a plain decode
    draft model                           k slots; the executor's drafter fills them

A request whose acceptance (moving average) falls below min_acceptance_rate pauses for
PAUSE_STEPS steps and then tries again with a fresh average.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from native_backend.config.engine import SpeculativeOptions
from native_backend.core.ngram import propose_ngram
from native_backend.core.sequence import Sequence
from native_backend.core.spec_stats import SpecDecodeStats, SpecState

EMA_WEIGHT = 0.3  # weight of the newest verification in a request's acceptance average
PAUSE_STEPS = 16  # steps a request with poor acceptance decodes plainly before trying again


@dataclass(frozen=True)
class Proposal:
    num_tokens: int  # k for this request this step (0: a plain decode)
    draft_token_ids: list[int]  # the drafts when known now (ngram); [] for a draft model


NO_PROPOSAL = Proposal(0, [])


class SpeculationPolicy:
    def __init__(self, options: SpeculativeOptions,
                 propose: Callable[[Sequence, int], list[int]] | None = None):
        """`propose(seq, k)`: drafts known at schedule time; by default n-gram lookup for method
        ngram, none (the executor's drafter) for method draft."""
        self.options = options
        self.k = options.num_speculative_tokens
        if propose is None and options.method == "ngram":
            propose = self._ngram
        self._propose = propose
        # Every position from the start, so a dashboard sees k series (zeros included) at once.
        self.stats = SpecDecodeStats(accepted_per_pos=[0] * self.k)

    def _ngram(self, seq: Sequence, k: int) -> list[int]:
        o = self.options
        return propose_ngram(seq.all_token_ids, k, o.prompt_lookup_min, o.prompt_lookup_max)

    def speculating(self, num_decodes: int) -> bool:
        """Whether anyone speculates in a step with this many decoding requests."""
        limit = self.options.max_batch_size
        return limit is None or num_decodes <= limit

    def propose(self, seq: Sequence, max_tokens: int) -> Proposal:
        """Drafts for seq, at most max_tokens (what the step's budget and the request's own
        remaining output allow)."""
        state = seq.spec if seq.spec is not None else SpecState()
        seq.spec = state
        if state.paused_steps:
            state.paused_steps -= 1
            return NO_PROPOSAL
        k = min(self.k, max_tokens)
        if k <= 0:
            return NO_PROPOSAL
        if self._propose is None:
            return Proposal(k, [])
        drafts = self._propose(seq, k)[:k]
        return Proposal(len(drafts), drafts) if drafts else NO_PROPOSAL

    def record(self, seq: Sequence, num_proposed: int, num_accepted: int) -> None:
        """A verification's outcome: counters, and the request's acceptance average."""
        self.stats.record(num_proposed, num_accepted)
        state = seq.spec
        state.counts.record(num_proposed, num_accepted)
        state.acceptance += EMA_WEIGHT * (num_accepted / num_proposed - state.acceptance)
        if state.acceptance < self.options.min_acceptance_rate:
            state.acceptance, state.paused_steps = 1.0, PAUSE_STEPS
