"""Speculation counters, in the names vLLM publishes (`vllm:spec_decode_*`), and one request's
speculation history (kept on its Sequence, read and written by core.spec_policy)."""

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
