"""Constrained decoding's step in sampling: a grammar's bitmask applied to its row's logits.

    bitmask row (int32 words):  word w, bit b  ->  token 32 * w + b allowed
    logits row:                 every token not allowed -> -inf (before logprobs, penalties, sampling)

In place, and only the rows with a mask: a batch without constrained rows is not looked at (no
copy, no kernel). Logits wider than the mask (an LM head padded past the tokenizer) are never
allowed there. Two paths, one contract:

- CPU: numpy unpacks the inverted words of all constrained rows at once (`np.unpackbits`, one
  byte per token, read as bools without a copy) and writes -inf through the logits' own memory
  (`np.copyto(..., where=)`, which walks the mask's runs: a grammar's masks are long runs of
  allowed or forbidden tokens). 20-30 us a row for SmolLM2's 49,152 tokens, where unpacking with
  torch shifts over a (rows, words, 32) int32 tensor and copying the logits took 0.1-2 ms a row
  (docs/engine/structured-outputs.md).
- CUDA: the packed words go to the GPU as they are (4 bytes per 32 tokens) and a Triton kernel
  (token_mask_triton) reads each word and writes -inf where its bit is clear, in place.
"""

from __future__ import annotations

import numpy as np
import torch

NEG_INF = float("-inf")


def apply_token_bitmasks(logits: torch.Tensor, bitmasks: list[np.ndarray | None]) -> torch.Tensor:
    """logits (rows, vocab) float; bitmasks[i]: row i's mask (num_words int32) or None
    (unconstrained). Sets the disallowed tokens of the constrained rows to -inf IN PLACE and
    returns `logits` (the sampler owns its logits: it made them float for itself)."""
    rows = [i for i, mask in enumerate(bitmasks) if mask is not None]
    if not rows:
        return logits
    words = np.stack([bitmasks[i] for i in rows])
    if logits.is_cuda:
        from native_backend.execution.token_mask_triton import apply_bitmask_inplace

        apply_bitmask_inplace(logits, torch.from_numpy(words).to(logits.device, non_blocking=True),
                              torch.tensor(rows, dtype=torch.int32).to(logits.device, non_blocking=True))
        return logits
    forbidden = forbidden_tokens(words, logits.shape[1])
    if logits.device.type == "cpu" and logits.dtype in _NUMPY_FLOATS:
        _fill_with_numpy(logits.detach().numpy(), forbidden.numpy(), rows)
    else:  # bf16 (no numpy type) or another device: torch's own masked fill
        forbidden = forbidden.to(logits.device)
        for j, i in enumerate(rows):
            logits[i].masked_fill_(forbidden[j], NEG_INF)
    return logits


# numpy writes -inf single-threaded: torch's masked_fill_ splits a 49,152-token row over its
# OpenMP threads, and on a busy CPU their barrier cost 0.3-17 ms a batch where numpy takes 20-30 us
# a row (measured in docs/engine/structured-outputs.md).
_NUMPY_FLOATS = (torch.float32, torch.float64, torch.float16)


def _fill_with_numpy(logits: np.ndarray, forbidden: np.ndarray, rows: list[int]) -> None:
    if len(rows) == logits.shape[0]:
        np.copyto(logits, -np.inf, where=forbidden)
        return
    for j, i in enumerate(rows):
        np.copyto(logits[i], -np.inf, where=forbidden[j])


def forbidden_tokens(words: np.ndarray, vocab: int) -> torch.Tensor:
    """(rows, num_words) int32 -> (rows, vocab) bool CPU tensor: which tokens are NOT allowed."""
    # Little-endian words: byte k of word w holds tokens 32 w + 8 k .. + 7, lowest bit first.
    inverted = np.invert(words.astype("<i4", copy=False))
    bits = np.unpackbits(inverted.view(np.uint8), axis=1, bitorder="little")  # (rows, 32 * num_words)
    if bits.shape[1] < vocab:  # tokens past the mask: never allowed
        bits = np.pad(bits, ((0, 0), (0, vocab - bits.shape[1])), constant_values=1)
    return torch.from_numpy(bits[:, :vocab].view(np.bool_))


def unpack_bitmask(words: np.ndarray, vocab: int, device) -> torch.Tensor:
    """(rows, num_words) int32 -> (rows, vocab) bool on `device`: which tokens are allowed."""
    return (~forbidden_tokens(words, vocab)).to(device)
