"""Speculation counters, in the names vLLM publishes (`vllm:spec_decode_*`), one request's
speculation history (kept on its Sequence, read and written by core.spec_policy), and how both
are reported: the engine's stats fields and a request's trace marks."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    num_drafts: int = 0  # verifications: requests x steps that carried drafts
    num_draft_tokens: int = 0  # tokens proposed and verified
    num_accepted_tokens: int = 0  # of those, accepted (the bonus/recovered token is not counted)
    accepted_per_pos: list[int] = field(default_factory=list)  # [j]: drafts accepted at position j

    def record(self, num_proposed: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_proposed
        self.num_accepted_tokens += num_accepted
        while len(self.accepted_per_pos) < num_proposed:
            self.accepted_per_pos.append(0)
        for j in range(num_accepted):
            self.accepted_per_pos[j] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verification: accepted drafts plus the one the target adds."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


@dataclass
class SpecState:
    """One request's speculation history (kept on its Sequence)."""

    acceptance: float = 1.0  # moving average of accepted / proposed
    paused_steps: int = 0
    counts: SpecDecodeStats = field(default_factory=SpecDecodeStats)  # this request's, for its trace


def engine_stats_fields(stats: SpecDecodeStats | None) -> dict:
    """The engine's `spec_decode_*` stats (EngineStats fields); none when speculation is off."""
    if stats is None:
        return {}
    return dict(spec_decode_num_speculative_tokens=len(stats.accepted_per_pos),
                spec_decode_num_drafts=stats.num_drafts, spec_decode_num_draft_tokens=stats.num_draft_tokens,
                spec_decode_num_accepted_tokens=stats.num_accepted_tokens,
                spec_decode_num_accepted_tokens_per_pos=tuple(stats.accepted_per_pos))


def trace_marks(counts: SpecDecodeStats | None) -> dict[str, float]:
    """One request's speculation for its trace (the gateway puts `spec_*` on its decode span):
    zeros when it never speculated (the load policy kept it plain), none when speculation is off."""
    if counts is None:
        return {}
    marks = {"spec_drafts": counts.num_drafts, "spec_draft_tokens": counts.num_draft_tokens,
             "spec_accepted_tokens": counts.num_accepted_tokens}
    if counts.num_draft_tokens:
        marks["spec_acceptance_rate"] = counts.acceptance_rate
        marks["spec_mean_accepted_length"] = counts.mean_accepted_length
    return {k: float(v) for k, v in marks.items()}
