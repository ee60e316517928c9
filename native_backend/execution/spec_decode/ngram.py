"""Prompt lookup (n-gram) proposals: copy what followed an earlier occurrence of the suffix.

    tokens:   ... the cat sat on the mat . the cat sat [on the mat .]   <- drafts
                  └──── match of the suffix "the cat sat" (n = 3) ┘

The longest suffix of length prompt_lookup_max .. prompt_lookup_min that occurred before wins;
among its occurrences, the latest one that still has k tokens after it (else the earliest, which
has the most). Pure Python and numpy, on the host. The scheduler asks for the count first
(`count_drafts`: slots only for drafts there are); the lookup made for it is kept, and the
executor's `propose` (before the step's tensors and a tensor-parallel step's deltas are built)
hands it out instead of looking again.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from native_backend.config.engine import SpeculativeOptions
from native_backend.core.batch import ScheduledChunk
from native_backend.execution.spec_decode.proposer import Proposals


class NgramProposer:
    """Proposer for method ngram: drafts from each request's own token history (no model)."""

    method = "ngram"

    def __init__(self, options: SpeculativeOptions):
        self.min_n, self.max_n = options.prompt_lookup_min, options.prompt_lookup_max
        self._counted: dict[str, tuple[int, list[int]]] = {}  # request -> (its length, drafts) for this step

    def count_drafts(self, request_id: str, tokens: list[int], k: int) -> int:
        """How many of k slots the lookup fills for this request now (0: no match)."""
        found = propose_ngram(tokens, k, self.min_n, self.max_n)
        if found:
            self._counted[request_id] = (len(tokens), found)
        else:
            self._counted.pop(request_id, None)
        return len(found)

    def propose(self, chunks: list[ScheduledChunk]) -> Proposals:
        drafts = {}
        for c in chunks:
            found = self._drafts(c)
            if found:
                drafts[c.request_id] = found
        return Proposals(drafts)

    def _drafts(self, chunk: ScheduledChunk) -> list[int]:
        """The lookup count_drafts made for this step, else a fresh one."""
        length = len(chunk.prompt_token_ids) + len(chunk.output_token_ids)
        counted = self._counted.pop(chunk.request_id, None)
        if counted is not None and counted[0] == length and len(counted[1]) == chunk.num_spec_tokens:
            return counted[1]
        return propose_ngram(chunk.prompt_token_ids + chunk.output_token_ids, chunk.num_spec_tokens,
                             self.min_n, self.max_n)

    def forget(self, request_ids) -> None:
        """Requests that ended or were preempted: their counted lookups go."""
        for request_id in request_ids:
            self._counted.pop(request_id, None)


def propose_ngram(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k tokens that followed the latest earlier match of tokens' suffix; [] if none."""
    length = len(tokens)
    if k <= 0 or length < min_n + 1:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        # Window i is arr[i : i + n]; i + n <= length - 1 leaves at least one token after it
        # and excludes the suffix itself.
        windows = sliding_window_view(arr[: length - 1], n)  # (length - n, n)
        hits = np.flatnonzero((windows == arr[length - n :]).all(axis=1))
        if hits.size:
            return arr[_pick(hits, n, k, length) :][:k].tolist()
    return []


def _pick(hits: np.ndarray, n: int, k: int, length: int) -> int:
    """Start of the continuation: the latest hit with k tokens after it, else the earliest hit."""
    full = hits[hits + n + k <= length]
    return int((full[-1] if full.size else hits[0]) + n)
