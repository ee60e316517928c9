"""Constrained decoding's mask on the GPU: a Triton kernel that sets the logits of the tokens a
grammar forbids to -inf, in place, reading the packed bitmask words as llguidance wrote them.

    grid (constrained rows, ceil(vocab / BLOCK)): program (r, b) takes tokens b*BLOCK .. +BLOCK of
    logits row rows[r], loads each token's word (token // 32) of mask row r and stores -inf where
    bit token % 32 is clear. Tokens past the mask (an LM head wider than 32 * num_words) are
    never allowed.

Only the constrained rows are launched; the words travel to the GPU packed (4 bytes per 32
tokens), never unpacked on the host. Tested on CPU under TRITON_INTERPRET=1 against the CPU path
(tests/native_backend/test_token_mask.py); `gpu_selfcheck` is bench/gpu_check.py's check on a GPU.
"""

from __future__ import annotations

import time

import torch
import triton
import triton.language as tl

BLOCK = 2048  # tokens per program: 64 words, 8 KiB of fp32 logits


@triton.jit
def _apply_bitmask_kernel(logits_ptr, words_ptr, rows_ptr, vocab, num_words, stride_row, BLOCK: tl.constexpr):
    r, b = tl.program_id(0), tl.program_id(1)
    row = tl.load(rows_ptr + r).to(tl.int64)
    tokens = b * BLOCK + tl.arange(0, BLOCK)
    in_vocab = tokens < vocab
    word_index = tokens // 32
    word = tl.load(words_ptr + r * num_words + word_index, mask=in_vocab & (word_index < num_words), other=0)
    forbidden = ((word >> (tokens % 32)) & 1) == 0
    neg_inf = tl.full((BLOCK,), float("-inf"), tl.float32)
    tl.store(logits_ptr + row * stride_row + tokens, neg_inf.to(logits_ptr.dtype.element_ty),
             mask=in_vocab & forbidden)


def apply_bitmask_inplace(logits: torch.Tensor, words: torch.Tensor, rows: torch.Tensor) -> None:
    """logits (batch, vocab) float, unit stride over the vocabulary; words (len(rows), num_words)
    int32; rows (len(rows),) int32: the logits row of each mask row. All on one device."""
    if logits.stride(1) != 1:
        raise ValueError("the logits must be contiguous over the vocabulary")
    words = words.contiguous()
    vocab, num_words = logits.shape[1], words.shape[1]
    grid = (rows.shape[0], triton.cdiv(vocab, BLOCK))
    _apply_bitmask_kernel[grid](logits, words, rows, vocab, num_words, logits.stride(0), BLOCK=BLOCK)


# (vocabulary, mask words): SmolLM2's, Llama 3's, one wider than its mask (32 tokens past it, a
# partial last word) and one whose mask is wider (1000 tokens, 32 words).
SELFCHECK_SHAPES = ((49152, 1536), (128256, 4008), (151945, 4748), (1000, 32))


def gpu_selfcheck(device, shapes=SELFCHECK_SHAPES, batch: int = 64) -> dict:
    """bench/gpu_check.py's check (it calls every native_backend module's gpu_selfcheck): random
    masks on every other row of a batch, fp32 and bf16 logits, against a numpy unpack of the same
    words on the host; and the kernel's time per constrained row at SmolLM2's vocabulary."""
    import numpy as np

    rng, failed, cases = np.random.default_rng(0), [], 0
    for vocab, num_words in shapes:
        words = rng.integers(-2**31, 2**31, (batch // 2, num_words), dtype=np.int64).astype(np.int32)
        rows = torch.arange(1, batch, 2)
        for dtype in (torch.float32, torch.bfloat16):
            logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(vocab)).to(dtype)
            expected = logits.clone()
            expected[rows] = logits[rows].masked_fill(~_allowed_on_host(words, vocab), float("-inf"))
            got = logits.to(device)
            apply_bitmask_inplace(got, torch.from_numpy(words).to(device), rows.to(device, torch.int32))
            cases += 1
            if not torch.equal(got.cpu(), expected):
                failed.append(f"vocab {vocab} {dtype}")
    return {"ok": not failed, "cases": cases, "failed": failed, "us_per_row": _time_per_row(device, 49152, batch)}


def _allowed_on_host(words, vocab: int) -> torch.Tensor:
    import numpy as np

    bits = np.unpackbits(words.astype("<i4").view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    allowed = torch.zeros(words.shape[0], vocab, dtype=torch.bool)
    allowed[:, : bits.shape[1]] = torch.from_numpy(bits.astype(bool))
    return allowed


def _time_per_row(device, vocab: int, rows: int) -> float:
    logits = torch.randn(rows, vocab, device=device)
    words = torch.randint(-2**31, 2**31 - 1, (rows, -(-vocab // 32)), dtype=torch.int32, device=device)
    index = torch.arange(rows, dtype=torch.int32, device=device)
    apply_bitmask_inplace(logits, words, index)  # compile
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
    started, repeats = time.perf_counter(), 20
    for _ in range(repeats):
        apply_bitmask_inplace(logits, words, index)
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
    return 1e6 * (time.perf_counter() - started) / (repeats * rows)
