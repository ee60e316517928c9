"""The rejection sampler emits tokens distributed exactly as the target's, at every position.

Vocabulary 10, k = 3, 100,000 requests in one batch: the emitted token at position j (among
requests that reach j) must be within total-variation 0.01 of p_j, for drafts from a real q and
for one-hot (n-gram) drafts. The drafts' own distribution is far from p (the test could fail).
"""

import pytest
import torch

from native_backend.execution.spec_decode.rejection import PAD, rejection_sample

VOCAB, K, N = 10, 3, 100_000


def _distributions(gen: torch.Generator, rows: int) -> torch.Tensor:
    return torch.softmax(3.0 * torch.randn(rows, VOCAB, generator=gen), dim=-1)  # (rows, vocab)


def _run(p: torch.Tensor, q: torch.Tensor, one_hot: bool, gen: torch.Generator):
    """p (k+1, vocab) and q (k, vocab) shared by all N requests; drafts drawn from q."""
    drafts = torch.stack([torch.multinomial(q[j], N, replacement=True, generator=gen) for j in range(K)], dim=1)
    noise = torch.empty(N, K + 1, VOCAB).exponential_(generator=gen)
    uniform = 1.0 - torch.rand(N, K, generator=gen)  # (0, 1]
    draft_probs = None if one_hot else q.expand(N, K, VOCAB)
    return drafts, rejection_sample(p.expand(N, K + 1, VOCAB), drafts, noise, draft_probs, uniform)


def _tv(samples: torch.Tensor, p: torch.Tensor) -> float:
    hist = torch.bincount(samples, minlength=VOCAB).double() / samples.numel()
    return 0.5 * float((hist - p.double()).abs().sum())


@pytest.mark.parametrize("one_hot", [False, True], ids=["draft-q", "one-hot-q"])
def test_emitted_tokens_follow_the_target_at_every_position(one_hot):
    gen = torch.Generator().manual_seed(1)
    p = _distributions(gen, K + 1)
    q = 0.5 * p[:K] + 0.5 * _distributions(gen, K)  # a draft that is often right, never equal
    if one_hot:  # n-gram-like drafts: usually the likeliest token (else positions 2-3 are rare)
        q = 0.6 * torch.nn.functional.one_hot(p[:K].argmax(dim=-1), VOCAB).float() + 0.4 * q
    drafts, (tokens, num_accepted) = _run(p, q, one_hot, gen)
    assert ((tokens != PAD).sum(dim=1) == num_accepted + 1).all()
    for j in range(K + 1):
        reached = tokens[:, j] != PAD
        assert reached.sum() > 20_000, f"position {j}: too few samples to judge"
        assert _tv(tokens[reached, j], p[j]) < 0.01, f"position {j}"
    # The test has teeth: the drafts themselves are visibly not the target's distribution.
    assert _tv(drafts[:, 0], p[0]) > 0.05


def test_a_draft_equal_to_the_target_is_always_accepted():
    gen = torch.Generator().manual_seed(7)
    p = _distributions(gen, K + 1)
    _, (tokens, num_accepted) = _run(p, p[:K].clone(), False, gen)
    assert (num_accepted == K).all()  # acceptance rate exactly 1.0
    assert _tv(tokens[:, K], p[K]) < 0.01  # and the bonus token still follows p_{k+1}


def test_greedy_rows_keep_the_drafts_up_to_the_first_mismatch():
    p = torch.zeros(1, K + 1, VOCAB)
    for j, token in enumerate([4, 7, 2, 9]):  # the target's argmax at each position
        p[0, j, token] = 1.0
    noise = torch.ones(1, K + 1, VOCAB)
    tokens, n = rejection_sample(p, torch.tensor([[4, 7, 5]]), noise)
    assert tokens.tolist() == [[4, 7, 2, PAD]] and n.tolist() == [2]
    tokens, n = rejection_sample(p, torch.tensor([[4, 7, 2]]), noise)
    assert tokens.tolist() == [[4, 7, 2, 9]] and n.tolist() == [3]
    # With a one-hot q given explicitly the rule is the same (u * 1 <= p(d) only when p(d) = 1).
    q = torch.nn.functional.one_hot(torch.tensor([[3, 7, 2]]), VOCAB).float()
    tokens, n = rejection_sample(p, torch.tensor([[3, 7, 2]]), noise, q, torch.full((1, K), 1e-9))
    assert tokens.tolist() == [[4, PAD, PAD, PAD]] and n.tolist() == [0]


def test_the_greedy_shortcut_keeps_the_rule():
    from native_backend.execution.spec_decode.rejection import accepted_prefix

    assert accepted_prefix([4, 7, 2, 9], [4, 7, 5]) == [4, 7, 2]
    assert accepted_prefix([4, 7, 2, 9], [4, 7, 2]) == [4, 7, 2, 9]
    assert accepted_prefix([4, 7, 2, 9], [3, 7, 2]) == [4]
