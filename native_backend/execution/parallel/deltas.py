"""What rank 0 sends the workers each step: only what changed since the last step.

The workers run the same forward pass as rank 0, so they need each chunk's tokens, positions and
block table, never the sampling settings or the token histories (penalties are applied on rank
0, which alone samples). Block tables grow a block at a time, so a chunk carries how much of the
table the worker already has (`keep`) and the new tail:

    rank 0 sent last step:  [7 3 9]        now: [7 3 9 12]   ->  keep 3, tail [12]
    preempted, back again:  (dropped)      now: [4 5]        ->  keep 0, tail [4 5]
    (a shortened table, e.g. a rolled-back block: keep < old length, tail = the rest)

Requests that ended or were preempted are listed once, and the workers forget their tables.

Speculative decoding: rank 0's proposer fills a chunk's draft slots before its delta is encoded,
so a verifying chunk reaches the workers as its last known token and its drafts [t | d1..dn]
(n + 1 logits rows), which the worker runs like any short chunk; who proposed the drafts does not
matter here. Nothing about the outcome is sent: rank 0's scheduler rolls the rejected drafts
back, and the next step's start_pos and block table (a released block: a shortened table) are all
the worker needs; the rejected positions' KV slots are overwritten by later steps on every rank alike.
"""

from __future__ import annotations

from dataclasses import dataclass

from native_backend.core.batch import ScheduledChunk, SchedulerOutput
from native_backend.core.sampling_params import SamplingParams

# (request_id, token_ids, draft_token_ids, start_pos, keep, tail, sample, num_logits)
ChunkDelta = tuple[str, list[int], list[int], int, int, list[int], bool, int]

EXECUTE, LOGITS, ALL_LOGITS = "execute", "logits", "all_logits"  # what the step computes


@dataclass
class StepDelta:
    mode: str  # EXECUTE (a served step), LOGITS / ALL_LOGITS (ModelRunner.compute_logits)
    dropped: list[str]  # ended or preempted since the last step
    chunks: list[ChunkDelta]


class DeltaEncoder:
    """Rank 0: remembers the block tables the workers hold."""

    def __init__(self) -> None:
        self.tables: dict[str, list[int]] = {}

    def encode(self, scheduled: SchedulerOutput, mode: str = EXECUTE) -> StepDelta:
        dropped = [*scheduled.finished_request_ids, *scheduled.preempted_request_ids]
        for request_id in dropped:
            self.tables.pop(request_id, None)
        chunks = []
        for c in scheduled.chunks:
            old, table = self.tables.get(c.request_id, []), c.block_table
            keep = _common_prefix(old, table)
            chunks.append((c.request_id, c.token_ids, c.draft_token_ids, c.start_pos, keep, table[keep:], c.sample,
                           c.num_logits))
            self.tables[c.request_id] = list(table)  # the scheduler's list keeps changing
        return StepDelta(mode, dropped, chunks)


class DeltaDecoder:
    """A worker: rebuilds each step's chunks from the deltas."""

    _PARAMS = SamplingParams()  # workers never sample; a chunk still needs one

    def __init__(self) -> None:
        self.tables: dict[str, list[int]] = {}

    def decode(self, delta: StepDelta) -> SchedulerOutput:
        for request_id in delta.dropped:
            self.tables.pop(request_id, None)
        chunks = []
        for request_id, token_ids, drafts, start_pos, keep, tail, sample, num_logits in delta.chunks:
            table = self.tables.get(request_id, [])[:keep] + tail
            self.tables[request_id] = table
            chunks.append(ScheduledChunk(request_id, token_ids, start_pos, table, sample, self._PARAMS,
                                         num_logits=num_logits, draft_token_ids=drafts))
        return SchedulerOutput(chunks, finished_request_ids=list(delta.dropped))


def _common_prefix(old, new: list[int]) -> int:
    n = min(len(old), len(new))
    if old[:n] == new[:n]:  # the usual case: the same table, or a block longer
        return n
    return next(i for i in range(n) if old[i] != new[i])
