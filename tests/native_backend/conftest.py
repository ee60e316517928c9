"""Scheduler test kit: a fake runner that really reads and writes a paged KV store, invariant
checks, and a scheduler factory whose teardown proves nothing leaked.

The fake runner's "model" samples next_token(history), where the history is read back from the
KV slots the scheduler pointed it at. A wrong block table, a prefix-cache hit on the wrong block,
or a shared block overwritten all change the tokens, so comparing outputs with
`expected_output()` checks the KV bookkeeping end to end.
"""

from __future__ import annotations

from collections import Counter

import pytest

from native_backend.core.batch import DraftCounts, RunnerOutput, SchedulerOutput
from native_backend.core.block_manager import cdiv
from native_backend.core.scheduler import Scheduler, SchedulerConfig, StepResult
from native_backend.core.sequence import SequenceStatus
from native_backend.execution.spec_decode.proposer import Proposals, propose_drafts

VOCAB = 32
EOS = 0


def next_token(history: list[int]) -> int:
    """The fake model: a deterministic function of the whole token history (never 0 = EOS
    unless the history hash lands there, which happens about 1 time in VOCAB)."""
    return hash(tuple(history)) % VOCAB


def expected_output(prompt: list[int], max_tokens: int, eos_token_id: int | None = None) -> list[int]:
    """What an unbatched, unpreempted run of the fake model generates."""
    history = list(prompt)
    out: list[int] = []
    while len(out) < max_tokens:
        token = next_token(history)
        history.append(token)
        out.append(token)
        if token == eos_token_id:
            break
    return out


class CallbackProposer:
    """A proposer (execution.spec_decode.proposer.Proposer) whose drafts come from
    `drafts(seq, k)`: tests choose right, wrong or no drafts."""

    method = "ngram"  # the name the scheduler's policy gives chunks for SpeculativeOptions("ngram")

    def __init__(self, scheduler: Scheduler, drafts):
        self.scheduler, self.drafts = scheduler, drafts

    def propose(self, chunks) -> Proposals:
        requests, found = self.scheduler.requests, {}
        for c in chunks:
            found[c.request_id] = self.drafts(requests[c.request_id], c.num_spec_tokens)[: c.num_spec_tokens]
        return Proposals({rid: drafts for rid, drafts in found.items() if drafts})

    def forget(self, request_ids) -> None:
        pass


class FakeKVRunner:
    """Plays the executor and its model runner: fills draft slots through the real
    `propose_drafts` with `drafts(seq, k)` (if given), writes each step token into its KV slot,
    then samples from the history it reads back from the slots."""

    def __init__(self, scheduler: Scheduler, drafts=None):
        self.scheduler = scheduler
        self.proposer = CallbackProposer(scheduler, drafts) if drafts is not None else None
        self.block_size = scheduler.config.block_size
        self.kv: dict[int, tuple[int, int]] = {}  # slot -> (position, token)
        self.steps = 0

    def slot(self, block_table: list[int], position: int) -> int:
        return block_table[position // self.block_size] * self.block_size + position % self.block_size

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        out, _ = propose_drafts(self.proposer, out)
        for chunk in out.chunks:
            tokens = chunk.token_ids + chunk.draft_token_ids  # drafts' KV is written too
            assert len(chunk.draft_token_ids) <= chunk.num_spec_tokens and chunk.num_logits == 1
            assert len(chunk.block_table) * self.block_size >= chunk.start_pos + len(tokens)
            for i, token in enumerate(tokens):
                self.kv[self.slot(chunk.block_table, chunk.start_pos + i)] = (chunk.start_pos + i, token)
        output = RunnerOutput()
        for chunk in out.chunks:
            if chunk.sample:
                output.sampled_token_ids[chunk.request_id] = emitted = self.verify(chunk)
                if chunk.draft_token_ids:
                    output.drafts[chunk.request_id] = DraftCounts(len(chunk.draft_token_ids), len(emitted) - 1)
        return output

    def verify(self, chunk) -> list[int]:
        """Greedy verification: the model's token after each accepted draft, up to the first
        token that differs from its draft (or the bonus token after all of them)."""
        end = chunk.start_pos + len(chunk.token_ids)
        drafts = chunk.draft_token_ids
        emitted = []
        for j in range(len(drafts) + 1):
            token = next_token(self.read_history(chunk.block_table, end + j))
            emitted.append(token)
            if j == len(drafts) or token != drafts[j]:
                return emitted

    def read_history(self, block_table: list[int], length: int) -> list[int]:
        history = []
        for position in range(length):
            stored_position, token = self.kv[self.slot(block_table, position)]
            assert stored_position == position, "KV slot holds another position's key/value"
            history.append(token)
        return history

    def step(self) -> tuple[SchedulerOutput, list[StepResult]]:
        """One engine step (schedule, execute, update) with invariant checks around it."""
        out = self.scheduler.schedule()
        assert_step_valid(self.scheduler, out)
        results = self.scheduler.update(out, self.execute(out))
        assert_consistent(self.scheduler)
        self.steps += 1
        return out, results

    def run_until_done(self, max_steps: int = 1000) -> list[SchedulerOutput]:
        outputs = []
        while self.scheduler.has_unfinished():
            assert len(outputs) < max_steps, "scheduler made no progress"
            outputs.append(self.step()[0])
        return outputs


def assert_step_valid(scheduler: Scheduler, out: SchedulerOutput) -> None:
    config = scheduler.config
    assert out.num_batched_tokens <= config.max_num_batched_tokens
    assert len(out.chunks) <= config.max_num_seqs
    assert len({c.request_id for c in out.chunks}) == len(out.chunks)
    for chunk in out.chunks:
        seq = scheduler.requests[chunk.request_id]
        assert seq.status is SequenceStatus.RUNNING
        assert chunk.token_ids, "empty chunk"
        assert chunk.start_pos == seq.num_computed_tokens
        assert chunk.token_ids == seq.all_token_ids[chunk.start_pos : chunk.start_pos + len(chunk.token_ids)]
        assert chunk.sample == (chunk.start_pos + len(chunk.token_ids) == seq.num_tokens)
        reserved = chunk.start_pos + len(chunk.token_ids) + chunk.num_spec_tokens
        assert len(seq.block_table) == cdiv(reserved, config.block_size)
        assert (chunk.proposer is not None) == bool(chunk.num_spec_tokens)  # slots always name who fills them
        assert not chunk.draft_token_ids  # the scheduler never makes drafts
        if chunk.num_spec_tokens:
            assert len(chunk.token_ids) == 1 and chunk.num_logits == 1
    assert not set(out.preempted_request_ids) & {c.request_id for c in out.chunks}


def assert_consistent(scheduler: Scheduler) -> None:
    """Between steps: every block is accounted for exactly once, every request is somewhere."""
    bm = scheduler.block_manager
    seqs = list(scheduler.requests.values())
    refs = Counter(b for seq in seqs for b in seq.block_table)
    free_ids, evictable = list(bm._free_ids), list(bm._evictable)
    assert len(set(free_ids)) == len(free_ids)
    assert not set(free_ids) & set(evictable)
    for block in bm.blocks:
        assert block.ref_count == refs[block.block_id], f"block {block.block_id} ref count"
        assert (block.ref_count == 0) == bm.is_free(block.block_id), f"block {block.block_id} free state"
    assert bm.num_free_blocks + len(refs) == bm.num_blocks
    assert all(bm.blocks[b].block_hash is not None for b in evictable)
    assert all(bm.blocks[b].block_hash is None for b in free_ids)
    for block_hash, block_id in bm._hash_to_block.items():
        assert bm.blocks[block_id].block_hash == block_hash
    # Every request is in exactly one queue, in the state that queue implies.
    running, waiting = scheduler.running, list(scheduler.waiting)
    assert len(running) + len(waiting) == len(seqs)
    assert {id(s) for s in running} | {id(s) for s in waiting} == {id(s) for s in seqs}
    assert len(running) <= scheduler.config.max_num_seqs
    for seq in running:
        assert seq.status is SequenceStatus.RUNNING
        assert len(set(seq.block_table)) == len(seq.block_table)
        assert len(seq.block_table) == cdiv(seq.num_computed_tokens, bm.block_size)
        assert seq.num_computed_tokens < seq.num_tokens  # the last token waits for its decode
    for seq in waiting:
        assert seq.status in (SequenceStatus.WAITING, SequenceStatus.PREEMPTED)
        assert seq.block_table == [] and seq.num_computed_tokens == 0


def assert_drained(scheduler: Scheduler) -> None:
    """Nothing left: no request, and every block free (possibly still cached, with ref 0)."""
    assert not scheduler.has_unfinished()
    assert scheduler.num_running == 0 and scheduler.num_waiting == 0
    bm = scheduler.block_manager
    assert all(block.ref_count == 0 for block in bm.blocks)
    assert bm.num_free_blocks == bm.num_blocks
    assert bm.usage() == 0.0


SMALL_CONFIG = dict(
    max_num_seqs=8,
    max_num_batched_tokens=32,
    block_size=4,
    num_blocks=64,
    max_model_len=128,
    enable_prefix_caching=True,
    eos_token_id=None,
)


@pytest.fixture
def make_scheduler():
    """Factory for small schedulers; after the test, each one must be fully drained."""
    created: list[Scheduler] = []

    def make(speculation=None, **overrides) -> Scheduler:
        scheduler = Scheduler(SchedulerConfig(**{**SMALL_CONFIG, **overrides}), speculation)
        created.append(scheduler)
        return scheduler

    yield make
    for scheduler in created:
        assert_drained(scheduler)


@pytest.fixture
def kit():
    """The helpers above, for test modules (importlib import mode: conftest is not importable)."""

    class Kit:
        FakeKVRunner = FakeKVRunner
        next_token = staticmethod(next_token)
        expected_output = staticmethod(expected_output)
        assert_consistent = staticmethod(assert_consistent)
        assert_step_valid = staticmethod(assert_step_valid)
        assert_drained = staticmethod(assert_drained)
        EOS = EOS
        VOCAB = VOCAB

    return Kit
