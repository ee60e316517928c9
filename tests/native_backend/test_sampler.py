from __future__ import annotations

import math

import pytest
import torch

from native_backend.core.sampling_params import SamplingParams as P
from native_backend.execution.sampler import Sampler, SamplingRow, apply_penalties, sampling_probs

torch.set_num_threads(1)
VOCAB = 50


def rand_logits(rows, seed=0):
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def row(rid, params, prompt=(), output=()):
    return SamplingRow(rid, params, list(prompt), list(output))


def test_greedy_is_argmax():
    logits = rand_logits(3)
    tokens, logprobs = Sampler()(logits, [row(str(i), P(temperature=0.0)) for i in range(3)])
    assert tokens == logits.argmax(-1).tolist()
    assert logprobs == [None, None, None]


def test_seeded_request_draws_the_same_tokens_whatever_the_batch():
    seeded = P(temperature=1.0, seed=1234)
    logits = rand_logits(1, seed=5)  # the seeded request's logits, the same every step
    alone, batched = Sampler(), Sampler()
    tokens_alone, tokens_batched = [], []
    for step in range(8):
        tokens_alone += alone(logits, [row("r", seeded)])[0]
        # Batched: different neighbours (seeded and not), and the request at a different row.
        others = rand_logits(2 + step % 3, seed=100 + step)
        rows = [row(f"o{i}", P(temperature=1.0, seed=step if i == 0 else None)) for i in range(len(others))]
        rows.insert(1, row("r", seeded))
        batch = torch.cat([others[:1], logits, others[1:]])
        tokens_batched.append(batched(batch, rows)[0][1])
    assert tokens_alone == tokens_batched
    assert len(set(tokens_alone)) > 1  # really sampled, not collapsed to the argmax


def test_forgetting_a_request_restarts_its_stream():
    sampler, logits, params = Sampler(), rand_logits(1, seed=9), P(temperature=1.0, seed=7)
    first = [sampler(logits, [row("r", params)])[0][0] for _ in range(5)]
    sampler.forget(["r"])
    again = [sampler(logits, [row("r", params)])[0][0] for _ in range(5)]
    assert first == again


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    sampler = Sampler(seed=0)
    counts = torch.zeros(3)
    for _ in range(2000):
        counts[sampler(logits, [row("r", P(temperature=1.0))])[0][0]] += 1
    torch.testing.assert_close(counts / 2000, torch.tensor([0.7, 0.2, 0.1]), atol=0.04, rtol=0)


def test_top_k_keeps_the_k_best():
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0, 2.0]])
    probs = sampling_probs(logits, [P(top_k=2)])
    assert (probs[0] > 0).tolist() == [False, True, False, True, False]
    torch.testing.assert_close(probs[0, [1, 3]], torch.softmax(torch.tensor([5.0, 4.0]), 0))


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    logits = torch.log(torch.tensor([[0.1, 0.5, 0.25, 0.15]]))
    probs = sampling_probs(logits, [P(top_p=0.7)])  # 0.5 + 0.25 >= 0.7: two tokens survive
    assert (probs[0] > 0).tolist() == [False, True, True, False]
    torch.testing.assert_close(probs[0, [1, 2]], torch.tensor([0.5, 0.25]) / 0.75)
    probs = sampling_probs(logits, [P(top_p=0.01)])  # the best token always survives
    assert (probs[0] > 0).tolist() == [False, True, False, False]


def test_min_p_drops_tokens_below_a_fraction_of_the_best():
    logits = torch.log(torch.tensor([[0.1, 0.5, 0.25, 0.15]]))
    probs = sampling_probs(logits, [P(min_p=0.3)])  # threshold 0.3 * 0.5 = 0.15
    assert (probs[0] > 0).tolist() == [False, True, True, True]


def test_filters_apply_per_row():
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0], [1.0, 5.0, 3.0, 4.0]])
    probs = sampling_probs(logits, [P(top_k=1), P()])
    assert (probs > 0).sum(-1).tolist() == [1, 4]


def test_temperature_sharpens():
    logits = torch.tensor([[1.0, 2.0]])
    probs = sampling_probs(logits, [P(temperature=0.5)])
    torch.testing.assert_close(probs[0], torch.softmax(torch.tensor([2.0, 4.0]), 0))


def test_repetition_penalty_hf_semantics_over_prompt_and_output():
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5]])
    out = apply_penalties(logits, [row("r", P(repetition_penalty=2.0), prompt=[0, 1], output=[1, 3])])
    # seen {0, 1, 3}: positive logits divided, negative multiplied; counted once however often seen
    torch.testing.assert_close(out, torch.tensor([[1.0, -4.0, 1.0, -2.0, 0.5]]))
    assert logits[0, 0] == 2.0  # the caller's tensor is left alone


def test_presence_and_frequency_penalties_openai_semantics_over_output_only():
    logits = torch.zeros(1, 5)
    params = P(presence_penalty=0.5, frequency_penalty=0.25)
    out = apply_penalties(logits, [row("r", params, prompt=[4, 4, 4], output=[1, 1, 1, 2])])
    # token 1: 3 * 0.25 + 0.5 = 1.25; token 2: 0.25 + 0.5 = 0.75; prompt token 4 untouched
    torch.testing.assert_close(out, torch.tensor([[0.0, -1.25, -0.75, 0.0, 0.0]]))


def test_penalties_change_the_greedy_choice():
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    tokens, _ = Sampler()(logits, [row("r", P(temperature=0.0, presence_penalty=1.0), output=[0])])
    assert tokens == [1]


def test_logprobs_are_raw_log_softmax_with_top_alternatives():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    params = P(temperature=0.0, logprobs=2, repetition_penalty=5.0)  # penalty must not show
    tokens, logprobs = Sampler()(logits, [row("r", params, output=[1])])
    raw = torch.log_softmax(logits[0], 0)
    lp = logprobs[0]
    assert lp.token_id == tokens[0] == 2  # the penalty moved the choice...
    assert lp.logprob == pytest.approx(raw[2].item())  # ...but the logprob is the raw one
    assert [t for t, _ in lp.top] == [1, 2]
    assert lp.top[0][1] == pytest.approx(raw[1].item())
    assert math.isclose(sum(math.exp(v) for v in raw.tolist()), 1.0, rel_tol=1e-6)


def test_logprobs_zero_gives_only_the_sampled_token():
    tokens, logprobs = Sampler()(rand_logits(2), [row("a", P(logprobs=0)), row("b", P())])
    assert logprobs[0].top == () and logprobs[0].token_id == tokens[0]
    assert logprobs[1] is None
