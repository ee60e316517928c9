"""The grammar's bitmask applied to logits, both paths against a plain reference written here
(token t allowed iff bit t % 32 of word t // 32): the CPU path (numpy unpack + masked_fill_, in
place, constrained rows only) and the Triton kernel of the CUDA path under TRITON_INTERPRET=1 (in
a subprocess, so the interpreter setting never leaks into other tests), over ragged row sets,
vocabularies wider and narrower than the mask, fp32 and bf16 logits; then the sampler's dispatch
to the kernel for CUDA tensors."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from native_backend.execution import token_mask
from native_backend.execution.sampler import Sampler, SamplingRow
from native_backend.core.sampling_params import SamplingParams
from native_backend.execution.token_mask import apply_token_bitmasks, unpack_bitmask
from tests.support.checks.skips import required

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# (batch, vocab, mask words, constrained rows): SmolLM2's 49,152 tokens; a vocabulary with a
# partial last word; one wider than its mask (tokens past it are never allowed); every row.
CASES = [(5, 49152, 1536, [1, 3]), (3, 1000, 32, [0, 2]), (4, 1000, 30, [2]), (2, 70, 3, [0, 1])]


def reference_mask(logits: torch.Tensor, masks: dict[int, np.ndarray]) -> torch.Tensor:
    out = logits.clone()
    for row, words in masks.items():
        for token in range(logits.shape[1]):
            word = token // 32
            if word >= len(words) or not (int(words[word]) >> (token % 32)) & 1:
                out[row, token] = float("-inf")
    return out


def random_case(batch, vocab, num_words, rows, dtype=torch.float32, seed=0):
    rng = np.random.default_rng(seed)
    masks = {r: rng.integers(-2**31, 2**31, num_words, dtype=np.int64).astype(np.int32) for r in rows}
    masks[rows[0]][:2] = [0, -1]  # a word allowing nothing, one allowing everything
    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(seed)).to(dtype)
    return logits, masks


@pytest.mark.parametrize("batch, vocab, num_words, rows", CASES)
def test_the_cpu_path_masks_the_constrained_rows_in_place(batch, vocab, num_words, rows):
    logits, masks = random_case(batch, vocab, num_words, rows)
    expected = reference_mask(logits, masks) if vocab < 2000 else None
    before = logits.clone()
    out = apply_token_bitmasks(logits, [masks.get(i) for i in range(batch)])
    assert out is logits  # in place
    if expected is not None:
        assert torch.equal(out, expected)
    for i in range(batch):
        if i in masks:
            allowed = unpack_bitmask(masks[i][None], vocab, "cpu")[0]
            assert torch.equal(torch.isfinite(out[i]), allowed) and torch.equal(out[i][allowed], before[i][allowed])
        else:
            assert torch.equal(out[i], before[i])  # unconstrained rows untouched


def test_a_batch_without_masks_is_not_touched():
    logits = torch.randn(3, 70)
    assert apply_token_bitmasks(logits, [None, None, None]) is logits


def test_the_sampler_only_draws_allowed_tokens_and_reports_masked_logprobs():
    vocab, allowed = 96, [7, 40, 95]
    words = np.zeros(3, dtype=np.int32)
    for t in allowed:
        words[t // 32] |= np.int32(1 << (t % 32)) if t % 32 < 31 else np.int32(-2**31)
    params = SamplingParams(temperature=1.0, logprobs=2)
    rows = [SamplingRow(f"r{i}", params, token_bitmask=words if i % 2 == 0 else None) for i in range(64)]
    tokens, logprobs = Sampler(seed=0)(torch.zeros(64, vocab), rows)
    assert set(tokens[0::2]) == set(allowed)  # uniform logits: every allowed token turns up, no other
    assert len(set(tokens[1::2])) > 10  # the plain rows draw from all 96
    lp = logprobs[0]
    assert lp.logprob == pytest.approx(-np.log(3)) and all(t in allowed for t, _ in lp.top)


# ------------------------------------------------------------------------------ Triton, interpreted


def need_triton() -> None:
    """A skip where triton is not installed; a failure where .ci/run says it is (it installs
    requirements.txt, which pins triton)."""
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        required("KVGATE_REQUIRE_TRITON", f"triton does not import here ({exc}): pip install -r requirements.txt")


def triton_checks() -> None:
    from native_backend.execution.token_mask_triton import apply_bitmask_inplace, gpu_selfcheck

    for i, (batch, vocab, num_words, rows) in enumerate(CASES):
        for dtype in (torch.float32, torch.bfloat16):
            logits, masks = random_case(batch, vocab, num_words, rows, dtype, seed=i)
            expected = apply_token_bitmasks(logits.clone(), [masks.get(r) for r in range(batch)])
            apply_bitmask_inplace(logits, torch.from_numpy(np.stack([masks[r] for r in rows])),
                                  torch.tensor(rows, dtype=torch.int32))
            assert torch.equal(logits, expected), (batch, vocab, num_words, rows, dtype)
            print(f"case {(batch, vocab, num_words, rows, dtype)}: ok")
    result = gpu_selfcheck("cpu", shapes=((1000, 32), (1100, 33)), batch=4)
    assert result["ok"] and result["cases"] == 4, result
    print("selfcheck: ok")


def test_the_triton_kernel_matches_the_cpu_path_under_the_interpreter():
    need_triton()
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": REPO_ROOT}
    proc = subprocess.run([sys.executable, os.path.abspath(__file__)], env=env, cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count(": ok") == 2 * len(CASES) + 1, proc.stdout


class CudaLooking(torch.Tensor):
    """A CPU tensor that says it is on CUDA: the dispatch, checked without a GPU."""

    @property
    def is_cuda(self):
        return True


def test_cuda_logits_go_to_the_triton_kernel(monkeypatch):
    need_triton()
    from native_backend.execution import token_mask_triton

    calls = []
    monkeypatch.setattr(token_mask_triton, "apply_bitmask_inplace", lambda *args: calls.append(args))
    logits = torch.randn(3, 64).as_subclass(CudaLooking)
    mask = np.full(2, -1, dtype=np.int32)
    assert token_mask.apply_token_bitmasks(logits, [None, mask, mask]) is logits
    (got, words, rows), = calls
    assert got is logits and words.tolist() == [[-1, -1]] * 2 and rows.tolist() == [1, 2]
    assert rows.dtype == torch.int32 and words.dtype == torch.int32


if __name__ == "__main__":
    triton_checks()
