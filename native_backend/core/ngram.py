"""Prompt lookup (n-gram) proposals: copy what followed an earlier occurrence of the suffix.

    tokens:   ... the cat sat on the mat . the cat sat [on the mat .]   <- drafts
                  └──── match of the suffix "the cat sat" (n = 3) ┘

The longest suffix of length prompt_lookup_max .. prompt_lookup_min that occurred before wins;
among its occurrences, the latest one that still has k tokens after it (else the earliest, which
has the most). Pure Python and numpy: the scheduler calls it for every decoding request.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


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
