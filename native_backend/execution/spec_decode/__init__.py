"""Speculative decoding: a cheap proposer guesses k tokens, the target scores them in one step.

    schedule() (core)                execute() (execution)                   update() (core)
    policy: n <= k draft slots     ─> the chunk's proposer fills the   ──> accepted + 1 tokens appended,
    for each decoding request, as     n drafts; the target runs [last,       the slots not accepted rolled
    many as the proposer counts       d1..dn]; rejection sampling keeps      back by the block manager;
    (0: a plain decode), named        a prefix of the drafts plus one        acceptance counted
    proposer                          token; DraftCounts per request

- `proposer`: the `Proposer` protocol, `Proposals`, and `propose_drafts` (the executor's one call);
- `ngram`: prompt lookup, the continuation of an earlier match of the sequence's suffix;
- `drafter`: a draft model's k passes (the target's first layers, self-speculative, or another checkpoint);
- `draft_model`: building and checking draft models, and their KV; `factory`: the proposer for a config;
- `rejection`: Leviathan et al. / Chen et al. rejection sampling (the target's distribution, exactly);
- in the core: `core.spec_policy` (which requests get slots, acceptance pauses) and
  `core.spec_stats` (counters for the engine's stats and each request's trace).
"""
