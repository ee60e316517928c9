"""Speculative decoding's pure parts: n-gram lookup and the proposer seam (the executor fills
the slots a chunk names), the policy, the scheduler's slots and rollback from the runner's counts,
and the sampler's verification against plain sampling (seeded streams included)."""

import pytest
import torch

from native_backend.config.engine import SpeculativeOptions
from native_backend.core.batch import DraftCounts, RunnerOutput, ScheduledChunk, SchedulerOutput
from native_backend.core.sampling_params import SamplingParams
from native_backend.core.sequence import Sequence
from native_backend.core.spec_policy import PAUSE_STEPS, NoSpeculation, SpeculationPolicy, speculation_policy
from native_backend.execution.spec_decode.ngram import NgramProposer, propose_ngram
from native_backend.execution.spec_decode.proposer import propose_drafts
from native_backend.execution.sampler import Sampler, SamplingRow

# --- n-gram lookup ----------------------------------------------------------------------------


@pytest.mark.parametrize("tokens, k, lo, hi, drafts", [
    ([1, 2, 3, 4, 5, 9, 1, 2, 3], 3, 2, 4, [4, 5, 9]),  # suffix "1 2 3" seen before
    ([1, 2, 3, 4, 7, 2, 3, 5, 9, 2, 3], 2, 2, 4, [5, 9]),  # the latest match with k tokens after it
    ([8, 2, 3, 4, 6, 2, 3], 3, 2, 4, [4, 6, 2]),
    ([1, 2, 3, 9, 9, 2, 3], 2, 3, 4, []),  # only a 2-token match, below prompt_lookup_min
    ([5, 6, 7], 2, 1, 4, []),  # nothing repeats
    ([4, 4, 4, 4], 3, 1, 3, [4]),  # the only match ends one token before the end
])
def test_ngram_proposes_the_continuation_of_the_longest_match(tokens, k, lo, hi, drafts):
    assert propose_ngram(tokens, k, lo, hi) == drafts


def test_ngram_prefers_the_longest_suffix():
    # "3" alone last occurred before 7; "2 3" before 4: the longer match wins.
    assert propose_ngram([2, 3, 4, 0, 3, 7, 2, 3], 1, 1, 3) == [4]


# --- the proposer seam: the executor fills the slots each chunk names ----------------------------


def _slots(request_id, history, k, proposer="ngram", drafts=()):
    return ScheduledChunk(request_id, history[-1:], len(history) - 1, [0, 1], True, SamplingParams(),
                          prompt_token_ids=history[:-1], output_token_ids=history[-1:], num_spec_tokens=k,
                          proposer=proposer, draft_token_ids=list(drafts))


def test_the_ngram_proposer_fills_the_slots_its_chunks_name():
    ngram = NgramProposer(SpeculativeOptions("ngram", prompt_lookup_min=2, prompt_lookup_max=3))
    step = SchedulerOutput([
        _slots("match", [1, 2, 3, 4, 5, 9, 1, 2, 3], 2),  # "1 2 3" seen before: [4, 5]
        _slots("none", [5, 6, 7, 8], 3),  # no match: a plain decode, its slots stay empty
        _slots("given", [7, 7], 2, proposer=None, drafts=[3]),  # carries its drafts: left alone
        ScheduledChunk("prefill", [1, 2, 3], 0, [2], False, SamplingParams()),
    ])
    filled, draft_probs = propose_drafts(ngram, step)
    assert [c.draft_token_ids for c in filled.chunks] == [[4, 5], [], [3], []]
    assert [c.num_logit_rows for c in filled.chunks] == [3, 1, 2, 1] and draft_probs == {}
    assert step.chunks[0].draft_token_ids == []  # the scheduler's output is not changed


def test_a_chunk_naming_another_proposer_is_refused():
    ngram = NgramProposer(SpeculativeOptions("ngram"))
    with pytest.raises(ValueError, match="asks for drafts from 'draft'; this engine's proposer is 'ngram'"):
        propose_drafts(ngram, SchedulerOutput([_slots("a", [1, 2, 1, 2], 2, proposer="draft")]))
    with pytest.raises(ValueError, match="this engine's proposer is None"):
        propose_drafts(None, SchedulerOutput([_slots("a", [1, 2, 1, 2], 2)]))


# --- policy ------------------------------------------------------------------------------------


def _seq(tokens=(1, 2, 3, 1, 2), outputs=(3,), max_tokens=50) -> Sequence:
    seq = Sequence("a", list(tokens), SamplingParams(max_tokens=max_tokens))
    seq.output_token_ids = list(outputs)
    seq.max_tokens = max_tokens
    return seq


def test_policy_stops_speculating_when_the_batch_is_large():
    policy = SpeculationPolicy(SpeculativeOptions("ngram", max_batch_size=4))
    assert policy.speculating(4) and not policy.speculating(5)
    assert SpeculationPolicy(SpeculativeOptions("ngram", max_batch_size=None)).speculating(10_000)


def test_policy_pauses_a_request_whose_drafts_keep_failing():
    policy = SpeculationPolicy(SpeculativeOptions("draft", num_speculative_tokens=3, draft_num_layers=2,
                                                  min_acceptance_rate=0.5))
    seq = _seq()
    assert policy.num_draft_slots(seq, 10) == 3 and policy.proposer == "draft"
    policy.record(seq, DraftCounts(3, 0))
    policy.record(seq, DraftCounts(0, 0))  # the proposer found nothing: not a verification
    policy.record(seq, DraftCounts(3, 0))  # average 1.0 -> 0.7 -> 0.49: below 0.5
    assert [policy.num_draft_slots(seq, 10) for _ in range(PAUSE_STEPS)] == [0] * PAUSE_STEPS
    assert policy.num_draft_slots(seq, 10) == 3  # then it tries again
    assert policy.num_draft_slots(seq, 1) == 1  # never more than the room it is given
    assert policy.stats.num_drafts == 2 and policy.stats.acceptance_rate == 0.0


def test_without_speculation_the_policy_gives_no_slots_and_counts_nothing():
    off = speculation_policy(None)
    assert isinstance(off, NoSpeculation) and not off.speculating(1) and off.num_draft_slots(_seq(), 10) == 0
    assert off.stats is None and off.request_counts(_seq()) is None and off.proposer is None


# --- the scheduler: slots, rollback from the runner's counts, no preemption for drafts ----------


def _policy(k=3):
    return SpeculationPolicy(SpeculativeOptions("ngram", num_speculative_tokens=k))


def _prefilled(sched, prompt_len=6, max_tokens=20):
    seq = Sequence("a", list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens))
    sched.add(seq)
    sched.update(sched.schedule(), RunnerOutput({rid: [9] for rid in sched.requests}))
    return seq


def test_rejected_drafts_give_back_their_blocks(make_scheduler):
    sched = make_scheduler(block_size=4, speculation=_policy())
    seq = _prefilled(sched)  # 6 prompt tokens computed, output [9] pending
    out = sched.schedule()
    (chunk,) = out.chunks
    assert (chunk.token_ids, chunk.num_spec_tokens, chunk.proposer, chunk.draft_token_ids) == ([9], 3, "ngram", [])
    assert len(seq.block_table) == 3  # positions 0..9: [9, d1, d2, d3] sit at 6..9
    kept = list(seq.block_table[:2])
    # drafts [10, 11, 12]: 10 accepted, 11 rejected -> 7 instead
    sched.update(out, RunnerOutput({"a": [10, 7]}, drafts={"a": DraftCounts(3, 1)}))
    assert seq.output_token_ids == [9, 10, 7] and seq.num_computed_tokens == 8
    assert seq.block_table == kept  # position 8 (token 7) goes into block 1 again
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks - 2
    stats = sched.stats().spec_decode
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 3, 1)
    sched.abort("a")


def test_drafts_never_preempt_and_fit_the_remaining_output(make_scheduler):
    sched = make_scheduler(block_size=4, num_blocks=2, speculation=_policy())
    _prefilled(sched, prompt_len=7, max_tokens=2)  # block 1 holds position 7 and nothing else can grow
    (chunk,) = sched.schedule().chunks
    assert chunk.num_spec_tokens == 0  # one more output token allowed: drafts could never be used
    sched.abort("a")
    sched = make_scheduler(block_size=4, num_blocks=3, speculation=_policy())
    sched.add(Sequence("b", [1, 2, 3], SamplingParams(max_tokens=5)))  # one block, held while it decodes
    _prefilled(sched, prompt_len=7, max_tokens=4)  # two blocks; drafts would need a third
    chunks = sched.schedule().chunks
    assert [c.num_spec_tokens for c in chunks] == [0, 0] and sched.num_running == 2  # plain decodes
    assert [c.proposer for c in chunks] == [None, None]
    sched.abort("a")
    sched.abort("b")


def test_slots_the_proposer_left_empty_are_rolled_back(make_scheduler):
    """3 slots, one draft found and accepted: the sequence grows by 2 tokens and keeps one
    block; a proposer that found nothing is a plain decode that counts no verification."""
    sched = make_scheduler(block_size=4, speculation=_policy())
    seq = _prefilled(sched)
    out = sched.schedule()
    sched.update(out, RunnerOutput({"a": [10, 7]}, drafts={"a": DraftCounts(1, 1)}))
    assert seq.output_token_ids == [9, 10, 7] and seq.num_computed_tokens == 8 and len(seq.block_table) == 2
    out = sched.schedule()
    assert out.chunks[0].num_spec_tokens == 3
    sched.update(out, RunnerOutput({"a": [8]}))  # no drafts this time
    assert seq.num_computed_tokens == 9 and len(seq.block_table) == 3  # position 8 is block 2's first
    stats = sched.stats().spec_decode
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 1, 1)
    sched.abort("a")


def test_slots_are_reserved_only_for_the_drafts_the_proposer_has(make_scheduler):
    """With the proposer's count, a request without an n-gram match takes one token of the budget,
    not 1 + k: the prefill beside it gets the rest; one with a match takes what it found, and the
    proposer fills exactly those slots (from the lookup it made for the count)."""
    options = SpeculativeOptions("ngram", num_speculative_tokens=3, prompt_lookup_min=2, prompt_lookup_max=3)
    ngram = NgramProposer(options)
    sched = make_scheduler(block_size=4, max_num_batched_tokens=8,
                           speculation=SpeculationPolicy(options, count_drafts=ngram.count_drafts))
    _prefilled(sched)  # tokens 1..6 then 9: nothing repeats
    sched.add(Sequence("b", list(range(20, 40)), SamplingParams(max_tokens=1)))
    out = sched.schedule()
    assert [(c.request_id, len(c.token_ids), c.num_spec_tokens, c.proposer) for c in out.chunks] == [
        ("a", 1, 0, None), ("b", 7, 0, None)]  # b's chunk: the whole budget but a's one token
    sched.update(out, RunnerOutput({"a": [1]}))
    sched.abort("b")
    sched.update(sched.schedule(), RunnerOutput({"a": [2]}))  # "9 1": still no match, a plain decode
    out = sched.schedule()  # "1 2" was seen at the start: drafts [3, 4, 5]
    assert [(c.num_spec_tokens, c.proposer) for c in out.chunks] == [(3, "ngram")]
    filled, _ = propose_drafts(ngram, out)
    assert filled.chunks[0].draft_token_ids == [3, 4, 5]
    sched.abort("a")


@pytest.mark.parametrize("sampled, drafts", [
    ([10, 7], None),  # two tokens, no verification reported
    ([10, 7, 8, 9, 5], DraftCounts(4, 4)),  # more drafts than the chunk had slots
])
def test_runner_counts_that_disagree_with_the_chunk_are_an_error(make_scheduler, sampled, drafts):
    sched = make_scheduler(block_size=4, speculation=_policy())
    _prefilled(sched)
    out = sched.schedule()
    with pytest.raises(RuntimeError, match="runner sampled"):
        sched.update(out, RunnerOutput({"a": sampled}, drafts={"a": drafts} if drafts else {}))
    sched.abort("a")


# --- the sampler's verification ----------------------------------------------------------------


def _plain_tokens(sampler, logits, row, drafts_then):
    """Plain sampling, one position at a time, with the drafts as history (what a non-speculative
    run does when it emits the same tokens)."""
    out = []
    for j in range(logits.shape[0]):
        r = SamplingRow(row.request_id, row.params, row.prompt_token_ids, row.output_token_ids + drafts_then[:j])
        (token,), _ = sampler(logits[j : j + 1], [r])
        out.append(token)
        if j < len(drafts_then) and token != drafts_then[j]:
            break
    return out


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.9, seed=5),
    SamplingParams(temperature=1.3, top_k=5, top_p=0.8, repetition_penalty=1.5, frequency_penalty=0.5, seed=9),
    SamplingParams(temperature=0.0, repetition_penalty=2.0),
])
def test_verification_draws_what_plain_sampling_draws(params):
    torch.manual_seed(0)
    logits = torch.randn(4, 12) * 3  # (k + 1, vocab)
    row = SamplingRow("r", params, [1, 2], [3])
    for drafts in ([0, 1, 2], [int(logits[0].argmax()), 4, 4], [5, 5, 5]):
        spec, plain = Sampler(), Sampler()
        tokens, _ = spec.verify(logits, row, drafts)
        assert tokens == _plain_tokens(plain, logits, row, drafts)
        if params.seed is not None:  # the generators agree afterwards: the next draw is the same
            nxt = SamplingRow("r", params, [1, 2], [3] + tokens)
            assert spec(logits[:1], [nxt])[0] == plain(logits[:1], [nxt])[0]
            assert torch.equal(spec._generators["r"].get_state(), plain._generators["r"].get_state())


# --- draft checks --------------------------------------------------------------------------------


def test_a_draft_must_share_the_vocabulary_and_be_no_larger():
    from types import SimpleNamespace

    from native_backend.execution.spec_decode.draft_model import check_draft_fits_target, check_same_tokenizer

    target = SimpleNamespace(vocab_size=100)
    check_draft_fits_target(SimpleNamespace(vocab_size=100), target, 50, 100)  # fits
    check_draft_fits_target(SimpleNamespace(vocab_size=100), target, 100, 100)  # the target itself: fits
    with pytest.raises(ValueError, match="vocabulary has 96 tokens, the target's 100"):
        check_draft_fits_target(SimpleNamespace(vocab_size=96), target, 50, 100)
    with pytest.raises(ValueError, match="more than the target's"):
        check_draft_fits_target(SimpleNamespace(vocab_size=100), target, 101, 100)
    check_same_tokenizer({"a": 0, "b": 1}, {"b": 1, "a": 0})
    with pytest.raises(ValueError, match="maps 2 tokens differently"):
        check_same_tokenizer({"a": 1, "b": 0}, {"a": 0, "b": 1})
