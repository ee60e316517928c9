"""Constrained decoding's step in sampling: a grammar's bitmask applied to its row's logits.

    bitmask row (int32 words):  word w, bit b  ->  token 32 * w + b allowed
    logits row:                 every token not allowed -> -inf (before logprobs, penalties, sampling)

Only rows with a mask are touched; a batch without constrained rows returns its logits as they
are (no copy, no kernel). One vectorised unpack for all constrained rows, on the logits' device
(CPU or CUDA alike). Logits wider than the mask (an LM head padded past the tokenizer) are never
allowed there.
"""

from __future__ import annotations

import numpy as np
import torch

_BITS = {}  # device -> the 32 bit positions, made once


def apply_token_bitmasks(logits: torch.Tensor, bitmasks: list[np.ndarray | None]) -> torch.Tensor:
    """logits (rows, vocab) float; bitmasks[i]: row i's mask or None (unconstrained).
    Returns logits with the disallowed tokens of the constrained rows at -inf (a new tensor
    when any row is constrained, the same one otherwise)."""
    rows = [i for i, mask in enumerate(bitmasks) if mask is not None]
    if not rows:
        return logits
    allowed = unpack_bitmask(np.stack([bitmasks[i] for i in rows]), logits.shape[1], logits.device)
    logits = logits.clone()
    index = torch.tensor(rows, device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
    return logits


def unpack_bitmask(words: np.ndarray, vocab: int, device) -> torch.Tensor:
    """(rows, num_words) int32 -> (rows, vocab) bool: which tokens are allowed."""
    packed = torch.from_numpy(words).to(device)
    bits = _BITS.get(packed.device)
    if bits is None:
        bits = _BITS[packed.device] = torch.arange(32, dtype=torch.int32, device=packed.device)
    allowed = ((packed.unsqueeze(-1) >> bits) & 1).bool().reshape(packed.shape[0], -1)
    if allowed.shape[1] >= vocab:
        return allowed[:, :vocab]
    return torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
