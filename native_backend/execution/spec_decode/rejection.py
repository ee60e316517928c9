"""Rejection sampling of drafts (Leviathan et al. 2211.17192, Chen et al. 2302.01318).

For each request, drafts d_1..d_k drawn from q, and the target's distributions p_1..p_{k+1}
(p_j computed as if d_1..d_{j-1} were accepted):

    j = 1..k:  accept d_j when u_j * q_j(d_j) <= p_j(d_j)      (probability min(1, p/q))
               on the first rejection emit a token from norm(max(p_j - q_j, 0)) and stop
    all k accepted: emit a bonus token from p_{k+1}

Every emitted token is then distributed exactly as the target's. With q one-hot (n-gram drafts,
or any draft of a greedy request) the rule is "draw x_j from p_j; accept d_j if x_j == d_j, else
emit x_j": P(accept) = p_j(d_j), and a rejection's x_j follows p_j without d_j, which is
norm(max(p_j - onehot(d_j), 0)). That form draws exactly what the plain sampler draws for the
same position, so a seeded request emits the same tokens with or without n-gram speculation.

Draws are Exp(1) noise: argmax(p / E) is a draw from p (as in `sampler`). Tensors are batched
over requests with the same k; `uniform` is in (0, 1] so a token with p = 0 is never accepted.
"""

from __future__ import annotations

import torch

PAD = -1  # after the last emitted token of a row


def rejection_sample(
    target_probs: torch.Tensor,  # (batch, k + 1, vocab): p_1..p_{k+1}
    draft_ids: torch.Tensor,  # (batch, k) int64
    noise: torch.Tensor,  # (batch, k + 1, vocab) Exp(1)
    draft_probs: torch.Tensor | None = None,  # (batch, k, vocab) q; None: one-hot at the drafts
    uniform: torch.Tensor | None = None,  # (batch, k) in (0, 1]; needed with draft_probs
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (tokens (batch, k + 1) padded with PAD, num_accepted (batch,)): each row emits
    its num_accepted leading drafts and one more token."""
    k = draft_ids.shape[1]
    p_draft = target_probs[:, :k].gather(-1, draft_ids[..., None]).squeeze(-1)  # (batch, k)
    if draft_probs is None:
        sampled = (target_probs / noise).argmax(dim=-1)  # (batch, k + 1): plain draws from p
        accepted = sampled[:, :k] == draft_ids
        recovered, bonus = sampled[:, :k], sampled[:, k]
    else:
        q_draft = draft_probs.gather(-1, draft_ids[..., None]).squeeze(-1)  # (batch, k)
        accepted = (uniform * q_draft <= p_draft) & (p_draft > 0)
        residual = (target_probs[:, :k] - draft_probs).clamp_min(0.0)  # (batch, k, vocab)
        recovered = (residual / noise[:, :k]).argmax(dim=-1)
        bonus = (target_probs[:, k] / noise[:, k]).argmax(dim=-1)
    num_accepted = accepted.long().cumprod(dim=-1).sum(dim=-1)  # (batch,): drafts before the first rejection
    last = torch.cat([recovered, bonus[:, None]], dim=1).gather(1, num_accepted[:, None])  # (batch, 1)
    position = torch.arange(k + 1, device=draft_ids.device)[None, :]
    tokens = torch.cat([draft_ids, torch.full_like(bonus[:, None], PAD)], dim=1)
    tokens = torch.where(position == num_accepted[:, None], last, tokens)
    tokens = torch.where(position > num_accepted[:, None], PAD, tokens)
    return tokens, num_accepted


def accepted_prefix(sampled: list[int], drafts: list[int]) -> list[int]:
    """One-hot q with the target's own draws `sampled` (k + 1 of them, e.g. a greedy argmax per
    position): the drafts up to the first that differs from its draw, then that draw (or the
    bonus draw when all match). The same rule as `rejection_sample` without draft_probs."""
    for j, draft in enumerate(drafts):
        if sampled[j] != draft:
            return drafts[:j] + [sampled[j]]
    return drafts + [sampled[len(drafts)]]
