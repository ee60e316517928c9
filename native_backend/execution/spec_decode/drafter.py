"""The draft-model proposer (method draft), asked by the executor right before the target's
verification step (`proposer.propose_drafts`).

For each chunk the scheduler gave k draft slots, the draft model runs k passes, batched over
those requests:

    pass 1:  catch-up tokens (draft KV it lacks) + the last known token  -> d_1 (and q_1)
    pass j:  d_{j-1} at position start_pos + j - 1                        -> d_j (and q_j)

writing its KV at start_pos .. start_pos + k - 1, slots the scheduler reserved in the request's
block table. A draft that shares the target's KV (self-speculative) never lags: the target's
KV of accepted tokens is its own. A separate draft model keeps its own cache in the same blocks
and remembers how far its KV is known good (`_computed`): the last known token, since the
drafts after it may be rejected. The next pass 1 recomputes whatever was accepted since then
(a few rows), so the drafter never needs to hear the verification's outcome.

Drafts are drawn from q: the draft's logits with the request's temperature and top-k / top-p /
min-p (any q keeps verification exact; a closer one is accepted more often). Greedy requests
take the draft's argmax. A seeded request's draft draws come from a generator of its own,
seeded apart from the target's, so the acceptance test stays independent of the drafts.
"""

from __future__ import annotations

import dataclasses

import torch

from native_backend.core.batch import ScheduledChunk
from native_backend.core.sequence import token_slice
from native_backend.execution.model_runner import ModelRunner
from native_backend.execution.sampler import sampling_probs
from native_backend.execution.spec_decode.proposer import Proposals

_DRAFT_SEED_MIX = 0x9E3779B97F4A7C15  # seeds the draft's stream apart from the target's


class DraftModelProposer:
    method = "draft"

    def __init__(self, runner: ModelRunner, shares_target_kv: bool):
        self.runner = runner  # the draft model over its KV (the target's first layers', or its own)
        self.shares_target_kv = shares_target_kv
        self._computed: dict[str, int] = {}  # request -> leading positions of good draft KV (own KV)
        self._generators: dict[str, torch.Generator] = {}
        self._shared = torch.Generator(device=runner.device)
        self._shared.seed()

    def count_drafts(self, request_id: str, tokens: list[int], k: int) -> int:
        """A draft model always draws k."""
        return k

    def forget(self, request_ids) -> None:
        """Requests that ended or were preempted (their blocks, and so the draft's KV, are gone)."""
        for request_id in request_ids:
            self._computed.pop(request_id, None)
            self._generators.pop(request_id, None)

    @torch.inference_mode()
    def propose(self, chunks: list[ScheduledChunk]) -> Proposals:
        """k drafts for each chunk (its slots), and q (k, vocab) for each sampled request."""
        drafts: dict[str, list[int]] = {c.request_id: [] for c in chunks}
        probs: dict[str, list[torch.Tensor]] = {c.request_id: [] for c in chunks if not c.sampling.greedy}
        step = [self._first_pass_chunk(c) for c in chunks]
        for j in range(max(c.num_spec_tokens for c in chunks)):
            active = [c for c in chunks if c.num_spec_tokens > j]
            tokens = self._draw(self._logits(step, active), active, probs)
            for chunk, token in zip(active, tokens):
                drafts[chunk.request_id].append(token)
            step = [_one_token(c, token, c.start_pos + j + 1) for c, token in zip(active, tokens)
                    if c.num_spec_tokens > j + 1]
        for chunk in chunks:
            if not self.shares_target_kv:
                self._computed[chunk.request_id] = chunk.start_pos + 1
        return Proposals(drafts, {rid: torch.stack(rows) for rid, rows in probs.items()})

    def _first_pass_chunk(self, chunk: ScheduledChunk) -> ScheduledChunk:
        """The last known token, after whatever the draft's own KV still lacks."""
        end = chunk.start_pos + len(chunk.token_ids)
        start = chunk.start_pos if self.shares_target_kv else min(self._computed.get(chunk.request_id, 0), chunk.start_pos)
        tokens = token_slice(chunk.prompt_token_ids, chunk.output_token_ids, start, end)  # of the request so far
        return dataclasses.replace(chunk, token_ids=tokens, start_pos=start, num_logits=1,
                                   num_spec_tokens=0, proposer=None, draft_token_ids=[], sample=True)

    def _logits(self, step: list[ScheduledChunk], active: list[ScheduledChunk]) -> torch.Tensor:
        runner = self.runner
        inputs = runner.prepare_inputs(step)
        hidden = runner.model(inputs.input_ids, inputs.positions, inputs.attn_metadata)
        return runner.model.compute_logits(hidden[inputs.logits_indices])  # (len(active), vocab)

    def _draw(self, logits: torch.Tensor, active: list[ScheduledChunk], probs) -> list[int]:
        tokens = logits.argmax(dim=-1)  # greedy rows keep this
        for i, chunk in enumerate(active):
            if chunk.sampling.greedy:
                continue
            q = sampling_probs(logits[i : i + 1].float(), [chunk.sampling])[0]  # (vocab,)
            noise = torch.empty_like(q).exponential_(generator=self._generator(chunk))
            tokens[i] = (q / noise).argmax()
            probs[chunk.request_id].append(q)
        return tokens.tolist()

    def _generator(self, chunk: ScheduledChunk) -> torch.Generator:
        seed = chunk.sampling.seed
        if seed is None:
            return self._shared
        gen = self._generators.get(chunk.request_id)
        if gen is None:
            gen = self._generators[chunk.request_id] = torch.Generator(device=self.runner.device)
            gen.manual_seed((seed * _DRAFT_SEED_MIX + 1) % 2**63)
        return gen


def _one_token(chunk: ScheduledChunk, token: int, position: int) -> ScheduledChunk:
    return dataclasses.replace(chunk, token_ids=[token], start_pos=position, num_logits=1, num_spec_tokens=0,
                               proposer=None, draft_token_ids=[], sample=True)
