"""Speculative decoding: a cheap proposer guesses k tokens, the target scores them in one step.

    schedule() (core)                execute() (execution)                   update() (core)
    policy: k draft slots for each ─> the chunk's proposer fills 0..k   ──> accepted + 1 tokens appended,
    decoding request (0: a plain      drafts; the target runs [last,         the slots not accepted rolled
    decode), named proposer           d1..dn]; rejection sampling keeps      back by the block manager;
                                      a prefix of the drafts plus one        acceptance counted
                                      token; DraftCounts per request

- `proposer`: the `Proposer` protocol, `Proposals`, and `propose_drafts` (the executor's one call);
- `ngram`: prompt lookup, the continuation of an earlier match of the sequence's suffix;
- `drafter`: a draft model's k passes (the target's first layers, self-speculative, or another checkpoint);
- `draft_model`: building and checking draft models, and their KV; `factory`: the proposer for a config;
- `rejection`: Leviathan et al. / Chen et al. rejection sampling (the target's distribution, exactly);
- in the core: `core.spec_policy` (which requests get slots, acceptance pauses) and
  `core.spec_stats` (counters for the engine's stats and each request's trace).
"""
