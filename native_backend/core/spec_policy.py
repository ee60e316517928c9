"""Which decoding requests speculate this step, and with how many draft slots (pure Python).

    decoding requests > max_batch_size    nobody speculates: a full batch has no spare compute,
                                          and k extra rows per request would only slow it down
    request paused                        no slots (it counts down its pause)
    otherwise                             as many slots as the proposer says it will fill, at
                                          most k (fewer near the end of its output): an n-gram
                                          lookup without a match takes none, so a plain decode
                                          never holds budget or blocks for drafts it cannot have

The policy never sees a draft: the proposers live on the execution side (execution.spec_decode);
the engine hands it their count (`count_drafts`, the executor's), never their tokens.
It hears each verification's counts (`record`): a request whose acceptance (moving average) falls
below min_acceptance_rate pauses for PAUSE_STEPS steps and then tries again with a fresh average.
`NoSpeculation` is the policy of an engine without speculation: no slots, no stats.
"""

from __future__ import annotations

from collections.abc import Callable

from native_backend.config.engine import SpeculativeOptions
from native_backend.core.batch import DraftCounts
from native_backend.core.sequence import Sequence
from native_backend.core.spec_stats import SpecDecodeStats, SpecState

EMA_WEIGHT = 0.3  # weight of the newest verification in a request's acceptance average
PAUSE_STEPS = 16  # steps a request with poor acceptance decodes plainly before trying again
NEVER_SPECULATED = SpecDecodeStats()  # a request's counts before its first slots (read only)

# (request_id, its tokens so far, k) -> how many of k draft slots the proposer fills for it now
DraftCount = Callable[[str, list[int], int], int]


class SpeculationPolicy:
    def __init__(self, options: SpeculativeOptions, count_drafts: DraftCount | None = None):
        self.options = options
        self.count_drafts = count_drafts  # None: the proposer may fill all k
        self.proposer = options.method  # the chunks' `proposer`: the execution side's proposer of this method
        self.k = options.num_speculative_tokens
        # Every position from the start, so a dashboard sees k series (zeros included) at once.
        self.stats: SpecDecodeStats | None = SpecDecodeStats(accepted_per_pos=[0] * self.k)

    def speculating(self, num_decodes: int) -> bool:
        """Whether anyone speculates in a step with this many decoding requests."""
        limit = self.options.max_batch_size
        return limit is None or num_decodes <= limit

    def num_draft_slots(self, seq: Sequence, max_tokens: int) -> int:
        """Draft slots for seq this step, at most max_tokens (what the step's budget and the
        request's own remaining output allow) and no more than the proposer has drafts for; 0
        while the request is paused."""
        state = seq.spec if seq.spec is not None else SpecState()
        seq.spec = state
        if state.paused_steps:
            state.paused_steps -= 1
            return 0
        k = max(0, min(self.k, max_tokens))
        if k and self.count_drafts is not None:
            return self.count_drafts(seq.request_id, seq.all_token_ids, k)
        return k

    def record(self, seq: Sequence, drafts: DraftCounts) -> None:
        """A verification's outcome: counters, and the request's acceptance average. A request
        whose proposer found no drafts this step verified nothing and counts nothing."""
        if not drafts.num_proposed:
            return
        self.stats.record(drafts.num_proposed, drafts.num_accepted)
        state = seq.spec
        state.counts.record(drafts.num_proposed, drafts.num_accepted)
        state.acceptance += EMA_WEIGHT * (drafts.num_accepted / drafts.num_proposed - state.acceptance)
        if state.acceptance < self.options.min_acceptance_rate:
            state.acceptance, state.paused_steps = 1.0, PAUSE_STEPS

    @staticmethod
    def request_counts(seq: Sequence) -> SpecDecodeStats:
        """This request's speculation so far, for its trace (zeros when it never speculated)."""
        return seq.spec.counts if seq.spec is not None else NEVER_SPECULATED


class NoSpeculation:
    """Speculation off: no request gets draft slots, nothing is counted."""

    proposer = None
    stats = None

    @staticmethod
    def speculating(num_decodes: int) -> bool:
        return False

    @staticmethod
    def num_draft_slots(seq: Sequence, max_tokens: int) -> int:
        return 0

    @staticmethod
    def record(seq: Sequence, drafts: DraftCounts) -> None:
        """Never called with drafts: no chunk had slots."""

    @staticmethod
    def request_counts(seq: Sequence) -> None:
        return None


def speculation_policy(options: SpeculativeOptions | None,
                       count_drafts: DraftCount | None = None) -> SpeculationPolicy | NoSpeculation:
    """The scheduler's policy for the engine's `speculative` settings (None: off); `count_drafts`:
    the executor's, so that slots are reserved only for drafts its proposer has."""
    return NoSpeculation() if options is None else SpeculationPolicy(options, count_drafts)
