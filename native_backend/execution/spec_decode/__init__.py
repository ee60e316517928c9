"""Speculative decoding: a cheap proposer guesses k tokens, the target scores them in one step.

    schedule()                       execute()                             update()
    policy: k for each decoding  ──> drafter (draft model) proposes     ──> accepted + 1 tokens appended,
    request (0: a plain decode);     the k tokens n-gram could not;         KV of the rejected rolled
    n-gram drafts found here         the target runs [last, d1..dk];        back by the block manager;
    (pure Python)                    rejection sampling keeps a prefix      acceptance counted
                                     of the drafts plus one token

- `core.ngram`: prompt lookup, the continuation of an earlier match of the sequence's suffix;
- `core.spec_policy`: which requests speculate and with how many tokens (batch size, acceptance);
- `rejection`: Leviathan et al. / Chen et al. rejection sampling (the target's distribution, exactly);
- `drafter`: a draft model (the target's first layers, or another checkpoint) run by the executor;
- `core.spec_stats`: counters for the engine's stats (drafts, draft tokens, accepted tokens per position).
"""
