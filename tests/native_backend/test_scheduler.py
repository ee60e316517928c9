"""Scheduler: chunked prefill, mixed batches, prefix hits, preemption, abort, priority, finishing.

Most tests drive the scheduler with the fake KV runner from conftest (`kit.FakeKVRunner`), whose
tokens depend on the history it reads back from the KV slots, and compare outputs with an
unbatched reference run.
"""

from __future__ import annotations

import pytest

from native_backend.config.engine import SpeculativeOptions
from native_backend.core.batch import DraftCounts, RunnerOutput, SampledLogprobs
from native_backend.core.sampling_params import SamplingParams
from native_backend.core.sequence import Sequence, SequenceStatus
from native_backend.core.spec_policy import SpeculationPolicy


def request(request_id: str, prompt: list[int], max_tokens: int | None = 4, **kwargs) -> Sequence:
    sampling = kwargs.pop("sampling", None) or SamplingParams(max_tokens=max_tokens)
    return Sequence(request_id, prompt, sampling=sampling, **kwargs)


def tokens(n: int, start: int = 1) -> list[int]:
    return [start + i % 29 for i in range(n)]  # never 0, the fake EOS


def scripted(out, tokens_by_request: dict[str, list[int]]) -> RunnerOutput:
    """Runner output giving each sampling chunk the scripted tokens."""
    return RunnerOutput({c.request_id: tokens_by_request[c.request_id] for c in out.chunks if c.sample})


# --- chunked prefill and batch composition ---------------------------------------------------


def test_long_prompt_is_prefilled_in_budget_sized_chunks(make_scheduler, kit):
    sched = make_scheduler(max_num_batched_tokens=8)
    prompt = tokens(20)
    sched.add(request("a", prompt, max_tokens=3))
    runner = kit.FakeKVRunner(sched)
    chunks = [runner.step()[0].chunks[0] for _ in range(3)]
    assert [(c.start_pos, len(c.token_ids), c.sample) for c in chunks] == [(0, 8, False), (8, 8, False), (16, 4, True)]
    assert [c.token_ids for c in chunks] == [prompt[0:8], prompt[8:16], prompt[16:20]]
    decode = runner.step()[0].chunks[0]
    assert (decode.start_pos, len(decode.token_ids), decode.sample) == (20, 1, True)
    runner.run_until_done()
    assert sched.stats().num_running == 0


def test_prefill_chunk_produces_no_result_until_the_prompt_is_done(make_scheduler, kit):
    sched = make_scheduler(max_num_batched_tokens=8)
    sched.add(request("a", tokens(12), max_tokens=1))
    runner = kit.FakeKVRunner(sched)
    assert runner.step()[1] == []
    (result,) = runner.step()[1]
    assert result.request_id == "a" and len(result.new_token_ids) == 1
    assert result.finish_reason == "length" and result.num_output_tokens == 1


def test_decodes_and_prefill_chunks_share_a_step(make_scheduler, kit):
    sched = make_scheduler(max_num_batched_tokens=10)
    runner = kit.FakeKVRunner(sched)
    sched.add(request("a", tokens(4), max_tokens=5))
    runner.step()  # a prefilled, now decoding
    sched.add(request("b", tokens(30, start=3), max_tokens=2))
    out, _ = runner.step()
    assert [(c.request_id, len(c.token_ids)) for c in out.chunks] == [("a", 1), ("b", 9)]
    out, _ = runner.step()  # decodes first, then the continuing prefill takes the rest
    assert [(c.request_id, len(c.token_ids)) for c in out.chunks] == [("a", 1), ("b", 9)]
    runner.run_until_done()


def test_a_long_prefill_threshold_admits_a_short_prompt_beside_a_long_ones_chunks(make_scheduler, kit):
    """Without it the long prompt's chunks take every step's whole budget and the short prompt
    waits for all of them; with it, the short prompt is computed in the next step."""
    for threshold, short_prompt_step in ((0, 3), (8, 1)):  # 0: the step that ends the long prompt
        sched = make_scheduler(max_num_batched_tokens=12, long_prefill_token_threshold=threshold)
        runner = kit.FakeKVRunner(sched)
        sched.add(request("long", tokens(40), max_tokens=2))
        first, _ = runner.step()
        assert [(c.request_id, len(c.token_ids)) for c in first.chunks] == [("long", threshold or 12)]
        sched.add(request("short", tokens(3, start=50), max_tokens=2))
        steps = [[(c.request_id, len(c.token_ids)) for c in runner.step()[0].chunks] for _ in range(4)]
        assert next(i for i, step in enumerate(steps, 1) if ("short", 3) in step) == short_prompt_step
        if threshold:  # the long prompt takes the threshold, the short one part of the rest
            assert steps[0] == [("long", 8), ("short", 3)] and steps[1] == [("short", 1), ("long", 8)]
        runner.run_until_done()


def test_decodes_go_before_prefills_of_more_important_requests(make_scheduler, kit):
    # A long prefill must not starve running decodes, even when it is the more important one.
    sched = make_scheduler(max_num_batched_tokens=4)
    runner = kit.FakeKVRunner(sched)
    sched.add(request("low", tokens(2), max_tokens=6, priority=1))
    runner.step()
    sched.add(request("high", tokens(12, start=3), max_tokens=2, priority=0))
    for _ in range(2):  # admission step, then a continuing-prefill step
        out, _ = runner.step()
        assert [(c.request_id, len(c.token_ids)) for c in out.chunks] == [("low", 1), ("high", 3)]
    runner.run_until_done()


def test_max_num_seqs_caps_running_requests(make_scheduler, kit):
    sched = make_scheduler(max_num_seqs=2)
    for i in range(3):
        sched.add(request(f"r{i}", tokens(3, start=i + 1)))
    runner = kit.FakeKVRunner(sched)
    out = runner.step()[0]
    assert [c.request_id for c in out.chunks] == ["r0", "r1"]
    assert (sched.num_running, sched.num_waiting) == (2, 1)
    runner.run_until_done()


def test_outputs_match_an_unbatched_run(make_scheduler, kit):
    sched = make_scheduler(max_num_batched_tokens=7)
    prompts = {f"r{i}": tokens(5 + 3 * i, start=i + 1) for i in range(5)}
    seqs = [request(rid, p, max_tokens=6) for rid, p in prompts.items()]
    for s in seqs:
        sched.add(s)
    kit.FakeKVRunner(sched).run_until_done()
    for s in seqs:
        assert s.output_token_ids == kit.expected_output(s.prompt_token_ids, 6)
        assert s.finish_reason == "length"


# --- prefix caching --------------------------------------------------------------------------


def test_second_request_starts_at_the_cached_prefix(make_scheduler, kit):
    sched = make_scheduler(block_size=4)
    runner = kit.FakeKVRunner(sched)
    shared = tokens(12)
    a = request("a", shared + [7, 7, 7, 7], max_tokens=3)
    sched.add(a)
    runner.step()  # a's 16 prompt tokens computed: 4 full blocks registered
    b = request("b", shared + [9, 9, 9], max_tokens=3)
    sched.add(b)
    out, _ = runner.step()
    (b_chunk,) = [c for c in out.chunks if c.request_id == "b"]
    assert b_chunk.start_pos == 12 and b_chunk.token_ids == [9, 9, 9]
    assert b_chunk.block_table[:3] == a.block_table[:3]
    assert b.num_cached_tokens == 12
    stats = sched.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (16 + 15, 12)
    runner.run_until_done()
    assert b.output_token_ids == kit.expected_output(b.prompt_token_ids, 3)


def test_finished_request_leaves_its_prefix_in_the_cache(make_scheduler, kit):
    sched = make_scheduler(block_size=4)
    runner = kit.FakeKVRunner(sched)
    sched.add(request("a", tokens(9), max_tokens=2))
    runner.run_until_done()
    assert sched.block_manager.num_cached_free_blocks >= 2
    b = request("b", tokens(9), max_tokens=2)  # same prompt: all but the last block hit
    sched.add(b)
    assert runner.step()[0].chunks[0].start_pos == 8
    runner.run_until_done()
    assert b.output_token_ids == kit.expected_output(b.prompt_token_ids, 2)


def test_prefix_cache_eviction_under_pressure_keeps_outputs_right(make_scheduler, kit):
    # A cache so small that every request evicts the previous requests' cached blocks.
    sched = make_scheduler(block_size=4, num_blocks=6, max_num_seqs=2)
    seqs = [request(f"r{i}", tokens(10 + i % 3, start=1 + i % 2), max_tokens=5) for i in range(6)]
    for s in seqs:
        sched.add(s)
    kit.FakeKVRunner(sched).run_until_done()
    assert sched.stats().prefix_cache_hits > 0
    for s in seqs:
        assert s.output_token_ids == kit.expected_output(s.prompt_token_ids, 5)


# --- preemption ------------------------------------------------------------------------------


def fill_cache_with_three_requests(make_scheduler, kit, priorities, **config):
    """6 blocks of 4 slots; three 7-token prompts hold 2 blocks each. The decode at position 8
    needs a third block per request, so the third step must preempt."""
    sched = make_scheduler(block_size=4, num_blocks=6, **config)
    seqs = [
        request(name, tokens(7, start=i + 1), max_tokens=6, priority=prio, arrival_time=float(i))
        for i, (name, prio) in enumerate(priorities)
    ]
    for s in seqs:
        sched.add(s)
    runner = kit.FakeKVRunner(sched)
    runner.step()  # prefill all three (positions 0..6)
    runner.step()  # decode position 7: still in the second block
    assert sched.block_manager.num_free_blocks == 0
    return sched, runner, seqs


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_victim_is_lowest_priority_then_latest_arrival(make_scheduler, kit, enable_prefix_caching):
    sched, runner, (a, b, c) = fill_cache_with_three_requests(
        make_scheduler, kit, [("a", 1), ("b", 1), ("c", 0)], enable_prefix_caching=enable_prefix_caching
    )
    out, _ = runner.step()
    # b and a share the lowest priority (1); b arrived later, so b goes.
    assert out.preempted_request_ids == ["b"]
    assert [ch.request_id for ch in out.chunks] == ["c", "a"]  # decodes in importance order
    assert b.status is SequenceStatus.PREEMPTED and b.block_table == []
    assert len(b.output_token_ids) == 2  # output so far is kept
    assert sched.num_preemptions == 1 and sched.stats().num_preemptions == 1
    runner.run_until_done()
    for s in (a, b, c):
        assert s.output_token_ids == kit.expected_output(s.prompt_token_ids, 6)


def test_preempted_request_resumes_by_reprefilling_prompt_and_output(make_scheduler, kit):
    sched, runner, (a, b, c) = fill_cache_with_three_requests(
        make_scheduler, kit, [("a", 0), ("b", 0), ("c", 0)], enable_prefix_caching=False
    )
    out, _ = runner.step()
    assert out.preempted_request_ids == ["c"]
    assert out.finished_request_ids == []  # preempted is not finished
    while c.status is not SequenceStatus.RUNNING:
        runner.step()
    resumed = runner.scheduler.get("c")
    assert resumed is c and c.num_computed_tokens == 9  # 7 prompt + 2 output re-prefilled ...
    assert len(c.output_token_ids) == 3  # ... and the chunk sampled the next token
    runner.run_until_done()
    assert c.output_token_ids == kit.expected_output(c.prompt_token_ids, 6)
    assert c.num_preemptions >= 1


def test_victim_already_in_the_batch_is_taken_out_of_it(make_scheduler, kit):
    # low's decode is scheduled first (decodes go first); then high's prefill chunk needs a
    # block, none is free, and low is the least important: its chunk must leave the batch.
    sched = make_scheduler(block_size=4, num_blocks=4, max_num_batched_tokens=4)
    runner = kit.FakeKVRunner(sched)
    low = request("low", tokens(3), max_tokens=10, priority=1)
    sched.add(low)
    runner.step()
    high = request("high", tokens(13, start=4), max_tokens=2, priority=0)
    sched.add(high)
    while not sched.num_preemptions:
        out, _ = runner.step()
    assert out.preempted_request_ids == ["low"]
    assert [c.request_id for c in out.chunks] == ["high"]
    runner.run_until_done()
    assert low.output_token_ids == kit.expected_output(low.prompt_token_ids, 10)
    assert high.output_token_ids == kit.expected_output(high.prompt_token_ids, 2)


def test_a_request_with_a_step_in_flight_is_neither_scheduled_nor_preempted(make_scheduler, kit):
    """Pipeline parallelism keeps steps in flight: schedule(busy) leaves their requests out (their
    next token is not known yet) and never preempts one (its step is still writing its blocks).
    c, the least important, is the victim of a full cache; in flight, it is left alone and b goes."""
    sched, runner, (a, b, c) = fill_cache_with_three_requests(make_scheduler, kit, [("a", 0), ("b", 0), ("c", 1)])
    out = sched.schedule(busy={"c"})
    assert [ch.request_id for ch in out.chunks] == ["a"] and out.preempted_request_ids == ["b"]
    assert c.status is SequenceStatus.RUNNING and c.block_table
    sched.update(out, runner.execute(out))
    kit.assert_consistent(sched)
    runner.run_until_done()
    for s in (a, b, c):
        assert s.output_token_ids == kit.expected_output(s.prompt_token_ids, 6)


def test_a_step_that_preempts_admits_nobody(make_scheduler, kit):
    sched, runner, _ = fill_cache_with_three_requests(make_scheduler, kit, [("a", 0), ("b", 0), ("c", 0)])
    sched.add(request("late", tokens(1), max_tokens=1, priority=-5))
    out, _ = runner.step()
    assert out.preempted_request_ids and "late" not in [ch.request_id for ch in out.chunks]
    runner.run_until_done()


def test_a_long_prefill_preempts_itself_rather_than_more_important_decodes(make_scheduler, kit):
    sched = make_scheduler(block_size=4, num_blocks=5, max_num_batched_tokens=4)
    runner = kit.FakeKVRunner(sched)
    important = request("important", tokens(3), max_tokens=8, priority=0)
    sched.add(important)
    runner.step()
    bulk = request("bulk", tokens(14, start=5), max_tokens=2, priority=9)
    sched.add(bulk)
    preempted = []
    while sched.has_unfinished():
        out, _ = runner.step()
        preempted += out.preempted_request_ids
    assert "important" not in preempted
    assert important.output_token_ids == kit.expected_output(important.prompt_token_ids, 8)
    assert bulk.output_token_ids == kit.expected_output(bulk.prompt_token_ids, 2)


# --- abort and finish ------------------------------------------------------------------------


def test_abort_frees_all_blocks_at_once(make_scheduler, kit):
    sched = make_scheduler(block_size=4)
    runner = kit.FakeKVRunner(sched)
    a = request("a", tokens(10), max_tokens=20)
    sched.add(a)
    runner.step()
    runner.step()
    assert sched.block_manager.usage() > 0
    assert sched.abort("a")
    assert a.status is SequenceStatus.FINISHED and a.finish_reason == "abort"
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks
    assert not sched.has_unfinished()
    out = sched.schedule()
    assert out.finished_request_ids == ["a"] and out.is_empty
    assert sched.schedule().finished_request_ids == []  # reported once
    assert not sched.abort("a") and not sched.abort("never-added")


def test_abort_of_a_waiting_request(make_scheduler):
    sched = make_scheduler()
    sched.add(request("a", tokens(3)))
    assert sched.abort("a")
    assert sched.num_waiting == 0 and sched.schedule().finished_request_ids == ["a"]


def test_finish_between_schedule_and_update_drops_the_late_tokens(make_scheduler, kit):
    sched = make_scheduler()
    runner = kit.FakeKVRunner(sched)
    a = request("a", tokens(3), max_tokens=10)
    sched.add(a)
    runner.step()
    out = sched.schedule()
    assert sched.finish("a", "stop")  # the engine matched a stop string meanwhile
    assert sched.update(out, runner.execute(out)) == []
    assert a.finish_reason == "stop" and len(a.output_token_ids) == 1
    assert sched.schedule().finished_request_ids == ["a"]


def test_finished_requests_are_reported_to_the_runner_next_step(make_scheduler, kit):
    sched = make_scheduler()
    runner = kit.FakeKVRunner(sched)
    sched.add(request("a", tokens(3), max_tokens=1))
    sched.add(request("b", tokens(3, start=4), max_tokens=3))
    _, results = runner.step()
    assert {r.request_id: r.finish_reason for r in results} == {"a": "length", "b": None}
    out, _ = runner.step()
    assert out.finished_request_ids == ["a"]
    runner.run_until_done()


# --- priority --------------------------------------------------------------------------------


def test_priority_orders_admission_then_arrival(make_scheduler, kit):
    sched = make_scheduler(max_num_seqs=1)
    sched.add(request("low", tokens(3), max_tokens=1, priority=5, arrival_time=0.0))
    sched.add(request("high-late", tokens(3), max_tokens=1, priority=0, arrival_time=2.0))
    sched.add(request("high-early", tokens(3), max_tokens=1, priority=0, arrival_time=1.0))
    order = [c.request_id for out in kit.FakeKVRunner(sched).run_until_done() for c in out.chunks]
    assert order == ["high-early", "high-late", "low"]


def test_equal_arrival_times_keep_insertion_order(make_scheduler, kit):
    sched = make_scheduler(max_num_seqs=1)
    for name in ("x", "y", "z"):
        sched.add(request(name, tokens(2), max_tokens=1, arrival_time=0.0))
    order = [c.request_id for out in kit.FakeKVRunner(sched).run_until_done() for c in out.chunks]
    assert order == ["x", "y", "z"]


def test_blocked_head_of_queue_is_not_overtaken(make_scheduler, kit):
    sched = make_scheduler(block_size=4, num_blocks=4)
    runner = kit.FakeKVRunner(sched)
    sched.add(request("running", tokens(8), max_tokens=4))
    runner.step()  # holds 2 blocks (3 after its next decode)
    sched.add(request("big", tokens(12, start=2), max_tokens=1, priority=0))
    sched.add(request("small", tokens(2, start=3), max_tokens=1, priority=1))
    out, _ = runner.step()
    assert [c.request_id for c in out.chunks] == ["running"]  # big doesn't fit; small must wait
    runner.run_until_done()


# --- finish detection ------------------------------------------------------------------------


def run_scripted(sched, seq, script: list[int]):
    """Prefill seq, then feed it the scripted tokens one step at a time; return all results."""
    sched.add(seq)
    results = []
    for token in script:
        out = sched.schedule()
        results += sched.update(out, scripted(out, {seq.request_id: [token]}))
        if seq.is_finished:
            break
    return results


def test_eos_stops_and_is_the_last_token(make_scheduler):
    sched = make_scheduler(eos_token_id=2)
    s = request("a", tokens(3), max_tokens=10)
    results = run_scripted(sched, s, [5, 6, 2, 7])
    assert s.output_token_ids == [5, 6, 2] and s.finish_reason == "stop"
    assert results[-1].finish_reason == "stop" and results[-1].new_token_ids == [2]
    assert sched.schedule().finished_request_ids == ["a"]


def test_ignore_eos_and_per_request_eos(make_scheduler):
    sched = make_scheduler(eos_token_id=2)
    s = request("a", tokens(3), sampling=SamplingParams(max_tokens=3, ignore_eos=True))
    run_scripted(sched, s, [2, 2, 2, 2])
    assert s.output_token_ids == [2, 2, 2] and s.finish_reason == "length"
    t = request("b", tokens(3), max_tokens=5, eos_token_id=9)  # overrides the config's EOS
    run_scripted(sched, t, [2, 9, 4])
    assert t.output_token_ids == [2, 9] and t.finish_reason == "stop"


def test_stop_token_ids_stop_even_when_ignoring_eos(make_scheduler):
    sched = make_scheduler()
    s = request("a", tokens(3), sampling=SamplingParams(max_tokens=9, stop_token_ids=(8,), ignore_eos=True))
    run_scripted(sched, s, [4, 8, 4])
    assert s.output_token_ids == [4, 8] and s.finish_reason == "stop"


def test_max_model_len_ends_requests_without_max_tokens(make_scheduler):
    sched = make_scheduler(max_model_len=10)
    s = request("a", tokens(7), max_tokens=None)
    run_scripted(sched, s, [4] * 10)
    assert len(s.output_token_ids) == 3 and s.finish_reason == "length"
    assert s.num_tokens == 10


def test_speculative_tokens_after_a_stop_are_dropped(make_scheduler):
    policy = SpeculationPolicy(SpeculativeOptions("ngram", num_speculative_tokens=2))
    sched = make_scheduler(eos_token_id=2, speculation=policy)
    s = request("a", tokens(3), max_tokens=10)
    sched.add(s)
    sched.update(sched.schedule(), RunnerOutput({"a": [5]}))  # the prompt: no draft slots yet
    out = sched.schedule()
    assert out.chunks[0].num_spec_tokens == 2 and out.chunks[0].proposer == "ngram"
    logprobs = [SampledLogprobs(t, -0.5) for t in (2, 6, 7)]
    runner = RunnerOutput({"a": [2, 6, 7]}, logprobs={"a": logprobs},  # drafts [2, 6] accepted, and a bonus
                          drafts={"a": DraftCounts(2, 2)})
    (result,) = sched.update(out, runner)
    assert result.new_token_ids == [2] and result.finish_reason == "stop"
    assert result.logprobs == logprobs[:1]


def test_runner_that_samples_nothing_is_an_error(make_scheduler):
    sched = make_scheduler()
    sched.add(request("a", tokens(3)))
    out = sched.schedule()
    with pytest.raises(RuntimeError):
        sched.update(out, RunnerOutput())
    sched.abort("a")


# --- admission checks and stats --------------------------------------------------------------


@pytest.mark.parametrize(
    "prompt, max_tokens, why",
    [
        ([], 4, "empty"),
        (tokens(128), 4, "max_model_len"),
        (tokens(10), 0, "max_tokens"),
        (tokens(100), 150, "max_model_len"),  # 100 + 150 over the context, whatever the cache
        (tokens(100), 20, "whole cache"),  # 100 + 20 - 1 KV slots > 16
    ],
)
def test_add_rejects_requests_that_could_never_finish(make_scheduler, prompt, max_tokens, why):
    sched = make_scheduler(num_blocks=16, block_size=1)
    with pytest.raises(ValueError, match=why):
        sched.add(request("a", prompt, max_tokens=max_tokens))
    assert not sched.has_unfinished()


def test_add_rejects_duplicate_ids(make_scheduler):
    sched = make_scheduler()
    sched.add(request("a", tokens(3)))
    with pytest.raises(ValueError, match="duplicate"):
        sched.add(request("a", tokens(3)))
    sched.abort("a")


def test_stats_reflect_queues_and_kv_usage(make_scheduler, kit):
    sched = make_scheduler(block_size=4, num_blocks=10, max_num_seqs=1)
    sched.add(request("a", tokens(8)))
    sched.add(request("b", tokens(8, start=2)))
    assert (sched.stats().num_waiting, sched.stats().num_running) == (2, 0)
    runner = kit.FakeKVRunner(sched)
    runner.step()
    stats = sched.stats()
    assert (stats.num_waiting, stats.num_running) == (1, 1)
    assert stats.kv_cache_usage == pytest.approx(2 / 10)
    runner.run_until_done()
    assert sched.stats().kv_cache_usage == 0.0


def test_a_default_max_tokens_is_lowered_to_what_the_context_and_cache_leave(make_scheduler):
    """The client named no max_tokens, so the gateway sent its bound (server.limits.max_tokens):
    lowered to what the cache (and context) leave for this prompt, vLLM's default, not refused
    the way a client's own number over the cache is."""
    sched = make_scheduler(num_blocks=16, block_size=1)  # 16 KV slots
    plain = request("a", tokens(10), sampling=SamplingParams(max_tokens=4096, max_tokens_default=True))
    sched.add(plain)
    assert plain.max_tokens == 16 + 1 - 10  # the last token's KV slot is never needed
    with pytest.raises(ValueError, match="whole cache"):
        sched.add(request("b", tokens(10), max_tokens=100))  # the client's own number: refused
    sched.abort("a")
    wide = make_scheduler(num_blocks=1024, block_size=1)  # the context is now the smaller room
    long = request("c", tokens(100), sampling=SamplingParams(max_tokens=4096, max_tokens_default=True))
    wide.add(long)
    assert long.max_tokens == wide.config.max_model_len - 100
    wide.abort("c")


def test_a_pooling_prompt_may_fill_the_context_a_generation_may_not():
    """Nothing is generated after a pooling prompt: all max_model_len positions are its own."""
    from native_backend.core.scheduler import ContextLengthError, check_pooling_fits, check_request_fits

    check_pooling_fits(32, max_model_len=32, cache_slots=64)
    with pytest.raises(ContextLengthError, match="maximum context length is 32 tokens"):
        check_request_fits(32, None, max_model_len=32, cache_slots=64)
    with pytest.raises(ContextLengthError, match="the input has 33 tokens"):
        check_pooling_fits(33, max_model_len=32, cache_slots=64)
    with pytest.raises(ContextLengthError, match="whole cache holds \\(16 tokens\\)"):
        check_pooling_fits(20, max_model_len=32, cache_slots=16)


def test_a_pooling_request_is_prefilled_in_chunks_never_sampled_or_drafted_and_freed_at_its_end(make_scheduler):
    policy = SpeculationPolicy(SpeculativeOptions("ngram", num_speculative_tokens=2))
    sched = make_scheduler(speculation=policy, max_num_batched_tokens=8)
    s = Sequence("e", tokens(17), SamplingParams(), pooling="mean")
    sched.add(s)
    starts = []
    for _ in range(2):  # 8 + 8 tokens: no vector yet
        out = sched.schedule()
        (chunk,) = out.chunks
        assert not chunk.sample and chunk.pooling == "mean" and chunk.num_spec_tokens == 0
        starts.append(chunk.start_pos)
        assert sched.update(out, RunnerOutput()) == []
    out = sched.schedule()  # the last token alone: a "decode" shape, still never drafted
    assert out.chunks[0].token_ids == tokens(17)[16:] and out.chunks[0].num_spec_tokens == 0
    with pytest.raises(RuntimeError, match="pooled nothing"):
        sched.update(out, RunnerOutput())  # a runner that loses the vector is a bug, not a silent end
    (result,) = sched.update(out, RunnerOutput(pooled={"e": [0.6, 0.8]}))
    assert starts == [0, 8] and result.embedding == [0.6, 0.8] and result.finish_reason == "stop"
    assert result.num_prompt_tokens == 17 and result.new_token_ids == []
    assert not sched.has_unfinished() and sched.block_manager.num_free_blocks == sched.config.num_blocks
