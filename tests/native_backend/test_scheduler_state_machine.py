"""Random add / step / abort / finish sequences against tiny caches (preemption is the norm),
with and without speculative drafts (right, wrong, or right for a while).

After every rule: blocks are accounted for exactly once, every request sits in one queue, and
every request's output is a prefix of what an unbatched, unpreempted run produces. At the end
the machine keeps stepping: every request must finish, and the cache must drain.
"""

from __future__ import annotations

import itertools

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from native_backend.config.engine import SpeculativeOptions
from native_backend.core.block_manager import cdiv
from native_backend.core.sampling_params import SamplingParams
from native_backend.core.scheduler import Scheduler, SchedulerConfig
from native_backend.core.sequence import Sequence
from native_backend.core.spec_policy import SpeculationPolicy

# Prompts draw on a few shared prefixes so the prefix cache gets hits (and evictions).
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [5, 5, 5, 5, 5, 5, 5, 5]]
MAX_DRAIN_STEPS = 2000


class SchedulerMachine(RuleBasedStateMachine):
    kit = None  # the conftest helpers, bound by the test below

    @initialize(
        block_size=st.sampled_from([1, 2, 4]),
        num_slots=st.integers(8, 24),
        max_num_batched_tokens=st.integers(1, 16),
        max_num_seqs=st.integers(1, 6),
        enable_prefix_caching=st.booleans(),
        use_eos=st.booleans(),
        num_speculative=st.sampled_from([0, 1, 3]),
    )
    def setup(self, block_size, num_slots, max_num_batched_tokens, max_num_seqs, enable_prefix_caching, use_eos,
              num_speculative):
        config = SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            block_size=block_size,
            num_blocks=cdiv(num_slots, block_size),
            max_model_len=24,
            enable_prefix_caching=enable_prefix_caching,
            eos_token_id=self.kit.EOS if use_eos else None,
        )
        speculation = None
        if num_speculative:
            options = SpeculativeOptions("ngram", num_speculative_tokens=num_speculative, max_batch_size=4,
                                         min_acceptance_rate=0.3)
            speculation = SpeculationPolicy(options)
        self.scheduler = Scheduler(config, speculation)
        self.runner = self.kit.FakeKVRunner(self.scheduler, drafts=self.drafts if num_speculative else None)
        self.ids = (f"r{i}" for i in itertools.count())
        self.seqs: dict[str, Sequence] = {}  # every accepted request, ended or not
        self.reported_ended: list[str] = []
        self.started: set[str] = set()  # requests that got a first chunk

    # --- rules -------------------------------------------------------------------------------

    @rule(
        prefix=st.sampled_from(PREFIXES),
        prefix_len=st.integers(0, 8),
        suffix=st.lists(st.integers(1, 31), max_size=8),
        max_tokens=st.integers(1, 10),
        priority=st.integers(0, 2),
    )
    def add(self, prefix, prefix_len, suffix, max_tokens, priority):
        prompt = prefix[:prefix_len] + suffix
        seq = Sequence(next(self.ids), prompt, sampling=SamplingParams(max_tokens=max_tokens), priority=priority)
        config = self.scheduler.config
        # scheduler.check_request_fits: prompt + max_tokens within the context, and alone in the
        # cache at its longest (the last sampled token's KV is never needed)
        longest = len(prompt) + max_tokens - 1
        fits = (0 < len(prompt) and len(prompt) + max_tokens <= config.max_model_len
                and cdiv(longest, config.block_size) <= config.num_blocks)
        try:
            self.scheduler.add(seq)
        except ValueError:
            assert not fits, f"rejected a request that fits: {len(prompt)=} {max_tokens=}"
            return
        assert fits, "accepted a request that can never finish"
        self.seqs[seq.request_id] = seq

    @rule(num_steps=st.integers(1, 4))
    def steps(self, num_steps):
        for _ in range(num_steps):
            self.step()

    def step(self):
        out, results = self.runner.step()
        self.reported_ended += out.finished_request_ids
        if out.preempted_request_ids:
            event("preemption")
        if any(c.start_pos > 0 and c.request_id not in self.started for c in out.chunks):
            event("prefix cache hit")
        self.started.update(c.request_id for c in out.chunks)
        if any(len(r.new_token_ids) > 1 for r in results):
            event("drafts accepted")
        for result in results:
            assert self.seqs[result.request_id].output_token_ids[-len(result.new_token_ids) :] == result.new_token_ids

    @precondition(lambda self: self.scheduler.has_unfinished())
    @rule(data=st.data(), reason=st.sampled_from(["abort", "stop"]))
    def end_early(self, data, reason):
        """The client went away ("abort") or the engine matched a stop string ("stop")."""
        request_id = data.draw(st.sampled_from(sorted(self.scheduler.requests)))
        assert self.scheduler.finish(request_id, reason)
        seq = self.seqs[request_id]
        assert seq.block_table == [] and seq.finish_reason == reason

    # --- invariants ----------------------------------------------------------------------------

    @invariant()
    def blocks_and_queues_consistent(self):
        self.kit.assert_consistent(self.scheduler)

    @invariant()
    def outputs_follow_the_reference_run(self):
        for seq in self.seqs.values():
            reference = self.expected(seq)
            assert seq.output_token_ids == reference[: len(seq.output_token_ids)]

    @invariant()
    def no_request_lost(self):
        live = set(self.scheduler.requests)
        ended = {rid for rid, seq in self.seqs.items() if seq.is_finished}
        assert live | ended == set(self.seqs) and not live & ended

    def drafts(self, seq: Sequence, k: int) -> list[int]:
        """The reference run's next k tokens, one of them wrong about half the time (which one
        and whether depends on the request and position, not on the step)."""
        position = seq.num_output_tokens
        drafts = self.expected(seq)[position : position + k]
        noise = hash((seq.request_id, position))
        if drafts and noise % 2:
            i = noise // 2 % len(drafts)
            drafts[i] = (drafts[i] + 1) % self.kit.VOCAB
        if drafts and seq.num_output_tokens:
            event("speculation")
        return drafts

    def expected(self, seq: Sequence) -> list[int]:
        return self.kit.expected_output(seq.prompt_token_ids, seq.max_tokens, seq.eos_token_id)

    # --- the end -------------------------------------------------------------------------------

    def teardown(self):
        if not hasattr(self, "scheduler"):
            return
        for _ in range(MAX_DRAIN_STEPS):
            if not self.scheduler.has_unfinished():
                break
            self.step()
        assert not self.scheduler.has_unfinished(), "requests never finished"
        self.reported_ended += self.scheduler.schedule().finished_request_ids
        self.kit.assert_drained(self.scheduler)
        assert sorted(self.reported_ended) == sorted(self.seqs), "each end reported exactly once"
        for seq in self.seqs.values():
            if seq.finish_reason in ("length", "stop") and seq.output_token_ids == self.expected(seq):
                continue  # ran to its natural end
            # Ended early by abort() or finish(): a prefix of the natural output.
            assert seq.finish_reason in ("abort", "stop")


def test_scheduler_state_machine(kit):
    machine = type("BoundSchedulerMachine", (SchedulerMachine,), {"kit": kit})
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=80,
            stateful_step_count=40,
            deadline=None,
            suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
        ),
    )
