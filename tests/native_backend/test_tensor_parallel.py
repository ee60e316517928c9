"""Tensor parallelism on a tiny random GQA Llama (8 heads, 2 KV heads): TP 2 (KV heads split) and
TP 4 (each KV head replicated on two ranks) give TP 1's logits within 1e-5 over prefill (chunked)
and decode steps, through real worker processes and a gloo group; sizes that cannot split are
refused naming the valid ones; each rank holds 1/N of the split weights and of the KV bytes per
token; an AWQ int4 checkpoint whose shards would cut an int32 of packed columns or a quantization
group is refused naming the sizes that keep them whole; an int8 KV cache works under TP; the step deltas rebuild the scheduler's block tables; a
worker killed or stopped fails the step naming its rank, within the collective timeout, and
leaves no process behind; a draft model under TP is refused naming ngram, and n-gram verification
steps (drafts rejected, a block rolled back) sample what one rank samples; `prefill_matmul:
auto` is decided on every rank from rank 0's start-up probe."""

from __future__ import annotations

import os
import random
import signal
import time

import pytest
import torch

from native_backend.config.engine import EngineConfig, SpeculativeOptions
from native_backend.core.batch import DraftCounts, ScheduledChunk, SchedulerOutput
from native_backend.execution.factory import make_executor
from native_backend.execution.parallel import report
from native_backend.execution.parallel.deltas import DeltaDecoder, DeltaEncoder
from native_backend.execution.parallel.executor import TensorParallelError, check_supported
from native_backend.execution.spec_decode.ngram import NgramProposer
from native_backend.execution.spec_decode.proposer import propose_drafts
from native_backend.model.layers import prefill_attention, prefill_matmul
from native_backend.tools.quantize import QuantizeOptions, quantize_model
from tests.support.checks import cpu_flags
from tests.support.checks.tensor_parallel_checks import GREEDY, executor_for, max_difference, run_script, tiny_gqa_llama

pytestmark = pytest.mark.timeout(600)

PROMPTS = [[(7 * i + 3) % 95 + 1 for i in range(21)], [(5 * i + 11) % 95 + 1 for i in range(10)],
           [(3 * i + 2) % 95 + 1 for i in range(33)]]
DECODE_STEPS = 6


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.set_num_threads(1)
    return tiny_gqa_llama(tmp_path_factory.mktemp("tiny-gqa"))


@pytest.fixture(scope="module")
def single(checkpoint):
    executor = executor_for(checkpoint, 1)
    logits, fed = run_script(executor, PROMPTS, DECODE_STEPS)
    return executor, logits, fed


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_logits_equal_single_rank_over_prefill_and_decode(checkpoint, single, tp):
    one, logits_1, fed = single
    executor = executor_for(checkpoint, tp)
    try:
        logits_n, _ = run_script(executor, PROMPTS, DECODE_STEPS, feed=fed)
        assert max_difference(logits_n, logits_1) < 1e-5
        reports = executor.reports
    finally:
        executor.close()
    assert [p.exitcode for w in executor.workers for p in [w.process]] == [0] * (tp - 1)  # stopped cleanly
    _check_memory(one.memory_report(), reports, tp)


def _check_memory(single: dict, reports: list[dict], tp: int) -> None:
    """Each rank: 1/N of the split weights and of the KV bytes per token; what is replicated is named."""
    assert [r["rank"] for r in reports] == list(range(tp))
    whole = single["weights_by_kind"]
    kv_rows = 2 * 2 * 64 * 2 * 8 * 4  # k and v projections: 2 layers x 2 KV heads x head_dim 8 x hidden 64, fp32
    for r in reports:
        kinds = r["weights_by_kind"]
        if tp <= 2:  # KV heads split like everything else
            assert kinds[report.SPLIT] * tp == whole[report.SPLIT]
            assert report.KV_REPLICATED not in kinds
            assert r["kv_bytes_per_token"] * tp == single["kv_bytes_per_token"]
        else:  # 2 KV heads on 4 ranks: each rank a whole KV head, its k/v rows named as replicated
            assert kinds[report.SPLIT] * tp == whole[report.SPLIT] - kv_rows
            assert kinds[report.KV_REPLICATED] == kv_rows // 2
            assert r["kv_bytes_per_token"] * 2 == single["kv_bytes_per_token"]
        assert kinds[report.NORMS] == whole[report.NORMS]  # the RMSNorm vectors, on every rank
        assert r["num_blocks"] == reports[0]["num_blocks"]


def test_sampled_tokens_and_start_up_line_match_single_rank(checkpoint, single):
    one, _, _ = single
    executor = executor_for(checkpoint, 2)
    try:
        line = executor.describe()
        steps = [SchedulerOutput([ScheduledChunk("s", PROMPTS[2], 0, [40, 41, 42], True, GREEDY)])]
        got, want = executor.execute(steps[0]), one.execute(steps[0])
        assert got.sampled_token_ids == want.sampled_token_ids
        token = got.sampled_token_ids["s"][0]
        follow = SchedulerOutput([ScheduledChunk("s", [token], len(PROMPTS[2]), [40, 41, 42], True, GREEDY)],
                                 finished_request_ids=["r0"])
        assert executor.execute(follow).sampled_token_ids == one.execute(follow).sampled_token_ids
        assert executor.collective_seconds > 0
        assert executor.prefill_path == one.prefill_path != ""  # what /v1/models shows: rank 0's choice
    finally:
        executor.close()
    assert "2 tensor-parallel ranks (gloo" in line
    for rank in (0, 1):
        assert f"rank {rank}: weights" in line
    assert "replicated norms" in line and "1 KV heads/layer" in line


def test_int8_kv_cache_under_tp_matches_single_rank_int8(checkpoint):
    one = executor_for(checkpoint, 1, kv_cache_dtype="int8")
    logits_1, fed = run_script(one, PROMPTS, DECODE_STEPS)
    executor = executor_for(checkpoint, 2, kv_cache_dtype="int8")
    try:
        logits_2, _ = run_script(executor, PROMPTS, DECODE_STEPS, feed=fed)
        assert executor.rank.kv_cache.dtype.name == "int8"
    finally:
        executor.close()
    # int8 scales are per token and KV head: the same numbers whichever rank holds the head
    assert max_difference(logits_2, logits_1) < 1e-5


@pytest.mark.parametrize("tp", [3, 5, 16])
def test_sizes_that_cannot_split_are_refused_naming_the_valid_sizes(checkpoint, tp):
    config = EngineConfig.build(path=checkpoint, tensor_parallel_size=tp)
    with pytest.raises(ValueError, match=r"valid sizes for this model: 1, 2, 4, 8$") as info:
        check_supported(config)
    assert f"{tp} ranks cannot split" in str(info.value) and "attention heads" in str(info.value)


@pytest.mark.parametrize("group, tp, cut, valid", [
    (16, 2, "down_proj's int4 groups of 16 (a shard of 56 inputs would cut one)", "1"),
    (8, 4, "gate_proj/up_proj's packed int4 columns (a shard of 28 outputs would cut an int32 of 8)", "1, 2")])
def test_awq_sizes_that_would_cut_an_int32_or_a_group_are_refused_naming_the_valid_sizes(
        checkpoint, tmp_path, group, tp, cut, valid):
    """The heads and the MLP split at 2 and 4, but the int4 linears are packed 8 columns an int32
    and quantized in groups of inputs: MLP 112 is 56 inputs of down_proj a rank at TP 2 (3.5 groups
    of 16), 28 outputs of gate/up at TP 4 (3.5 int32s)."""
    awq = str(tmp_path / f"int4-g{group}")
    quantize_model(checkpoint, awq, QuantizeOptions(method="rtn", group_size=group))
    with pytest.raises(ValueError, match=rf"valid sizes for this model: {valid}$") as info:
        check_supported(EngineConfig.build(path=awq, tensor_parallel_size=tp))
    assert f"{tp} ranks cannot split int4-g{group}: " in str(info.value) and cut in str(info.value)


def test_a_draft_model_with_tp_is_refused_at_start_naming_ngram(checkpoint):
    config = EngineConfig.build(path=checkpoint, tensor_parallel_size=2,
                                speculative={"method": "draft", "draft_num_layers": 1})
    with pytest.raises(ValueError, match="size 2 with speculative method 'draft': not supported") as info:
        make_executor(config)
    assert "use speculative method 'ngram'" in str(info.value)
    check_supported(EngineConfig.build(path=checkpoint, tensor_parallel_size=2, speculative={"method": "ngram"}))


def test_verification_steps_sample_and_roll_back_as_on_one_rank(checkpoint, single):
    """Drafts as the proposer fills them: the last token and k drafts, one rejected; the
    rollback releases the block the drafts had spilled into, and the next step (a new block there,
    the rejected position rewritten) samples what one rank samples."""
    one, prompt = single[0], PROMPTS[0][:14]
    ahead = _greedy_continuation(one, prompt, 4, blocks=[100, 101])  # c0..c3, to draft from
    wrong = (ahead[2] + 1) % 96
    steps = [SchedulerOutput([ScheduledChunk("v", prompt, 0, [110], True, GREEDY)]),
             SchedulerOutput([ScheduledChunk("v", [ahead[0]], 14, [110, 111], True, GREEDY,
                                             num_spec_tokens=3, draft_token_ids=[ahead[1], wrong, ahead[3]])]),
             SchedulerOutput([ScheduledChunk("v", [ahead[2]], 16, [110, 112], True, GREEDY)])]
    executor = executor_for(checkpoint, 2)
    try:
        got = [executor.execute(s).sampled_token_ids["v"] for s in steps]
    finally:
        executor.close()
    want = [one.execute(s) for s in steps]
    assert got == [w.sampled_token_ids["v"] for w in want] == [[ahead[0]], [ahead[1], ahead[2]], [ahead[3]]]
    assert [w.drafts.get("v") for w in want] == [None, DraftCounts(3, 1), None]


def _greedy_continuation(executor, prompt: list[int], n: int, blocks: list[int]) -> list[int]:
    tokens = executor.execute(SchedulerOutput([ScheduledChunk("c", prompt, 0, blocks, True, GREEDY)])
                              ).sampled_token_ids["c"]
    for i in range(n - 1):
        step = SchedulerOutput([ScheduledChunk("c", tokens[-1:], len(prompt) + i, blocks, True, GREEDY)])
        tokens += executor.execute(step).sampled_token_ids["c"]
    return tokens


def test_deltas_rebuild_every_block_table_the_scheduler_sent():
    """Random steps: tables that grow, shrink (a rolled-back block), requests that end or are
    preempted and come back with new blocks; the worker's tables always equal rank 0's."""
    rng = random.Random(0)
    encoder, decoder, live = DeltaEncoder(), DeltaDecoder(), {}
    for _ in range(300):
        ended = [r for r in live if rng.random() < 0.1]
        for r in ended:
            del live[r]
        for _ in range(rng.randint(0, 2)):
            live[f"q{rng.randint(0, 10**6)}"] = [rng.randint(0, 99)]
        for r, blocks in live.items():
            action = rng.random()
            if action < 0.3:
                blocks.append(rng.randint(0, 99))
            elif action < 0.35 and len(blocks) > 1:
                blocks.pop()
            elif action < 0.4:
                blocks[:] = [rng.randint(0, 99) for _ in range(rng.randint(1, 4))]  # preempted, then back
        chunks = [ScheduledChunk(r, [1], 0, b, True, GREEDY) for r, b in live.items() if rng.random() < 0.8]
        delta = encoder.encode(SchedulerOutput(chunks, finished_request_ids=ended))
        rebuilt = decoder.decode(delta)
        assert [(c.request_id, c.block_table) for c in rebuilt.chunks] == [(c.request_id, c.block_table) for c in chunks]
        assert sum(len(c[5]) for c in delta.chunks) <= sum(len(c.block_table) for c in chunks)  # tails only


def test_a_verifying_chunk_reaches_the_workers_as_its_tokens_and_drafts():
    """The worker runs [last token | drafts] with n + 1 logits rows, whoever proposed the drafts;
    the executor's proposer fills a chunk's slots before its delta is encoded."""
    encoder, decoder = DeltaEncoder(), DeltaDecoder()
    slots = ScheduledChunk("a", [5], 20, [3, 4], True, GREEDY, prompt_token_ids=[5, 6, 7, 1, 2],
                           output_token_ids=[5], num_spec_tokens=3, proposer="ngram")
    filled, _ = propose_drafts(NgramProposer(SpeculativeOptions("ngram", prompt_lookup_min=1)), SchedulerOutput([slots]))
    (chunk,) = decoder.decode(encoder.encode(filled)).chunks
    assert (chunk.token_ids, chunk.draft_token_ids, chunk.start_pos, chunk.block_table) == ([5], [6, 7, 1], 20, [3, 4])
    assert chunk.num_logit_rows == 4 and chunk.proposer is None


@pytest.mark.parametrize("sig, rank, message", [
    (signal.SIGKILL, 3, r"tensor-parallel worker died: rank 3 was killed by SIGKILL$"),
    (signal.SIGSTOP, 2, r"did not answer within 3 s \(collective timeout\): rank 2 is stopped"),
])
def test_a_dead_or_stopped_worker_fails_the_step_naming_the_rank_and_nothing_is_left(checkpoint, sig, rank, message):
    executor = executor_for(checkpoint, 4, collective_timeout_s=3)
    processes = [w.process for w in executor.workers]
    try:
        step = SchedulerOutput([ScheduledChunk("a", PROMPTS[0], 0, [1, 2], True, GREEDY)])
        executor.execute(step)
        os.kill(processes[rank - 1].pid, sig)
        started = time.monotonic()
        with pytest.raises(TensorParallelError, match=message):
            executor.execute(SchedulerOutput([ScheduledChunk("a", [5], len(PROMPTS[0]), [1, 2], True, GREEDY)]))
        assert time.monotonic() - started < 30  # the collective timeout, not forever
    finally:
        executor.close()
    assert not any(p.is_alive() for p in processes)  # the stopped one killed, the others stopped


def test_an_idle_engine_notices_a_dead_worker(checkpoint):
    executor = executor_for(checkpoint, 2)
    try:
        executor.check_health()
        executor.workers[0].process.kill()
        executor.workers[0].process.join(10)
        with pytest.raises(TensorParallelError, match="rank 1 was killed by SIGKILL"):
            executor.check_health()
    finally:
        executor.close()


def test_workers_decide_prefill_matmul_auto_from_rank_0s_probe(checkpoint, tmp_path, monkeypatch):
    """auto's choice for int4 linears rests on a start-up probe; each rank probing on its own (while
    the others load) could choose differently. Rank 0's probe is faked at 1.2x here, which no
    worker measures on a CPU with AMX or AVX512_BF16, and none without (it says so, unprobed)."""
    awq = str(tmp_path / "int4-g8")
    quantize_model(checkpoint, awq, QuantizeOptions(method="rtn", group_size=8))
    monkeypatch.setattr(prefill_matmul, "_followed", ("AMX", 1.2))  # this process is rank 0
    notes = _prefill_notes(awq)
    assert notes == [notes[0]] * 2
    assert notes[0].startswith("prefill matmuls fp32 from") and "(auto: AMX, bf16 1.2x fp32" in notes[0]


def test_workers_decide_prefill_attention_auto_from_rank_0s_probe(checkpoint, tmp_path, monkeypatch):
    """The same for prefill attention's probe (it runs where the matmuls chose bf16: faked at 9x)."""
    awq = str(tmp_path / "int4-g8")
    quantize_model(checkpoint, awq, QuantizeOptions(method="rtn", group_size=8))
    monkeypatch.setattr(prefill_matmul, "_followed", ("AMX", 9.0))
    monkeypatch.setattr(prefill_attention, "_followed", 1.2)
    notes = _prefill_notes(awq)
    assert notes == [notes[0]] * 2 and "prefill matmuls bf16 from" in notes[0]
    followed = "prefill attention fp32 (auto: AVX512_BF16, bf16 1.2x"  # the CPU runs it: rank 0's probe decides
    assert (followed if cpu_flags.has(cpu_flags.BF16_ATTENTION) else "prefill attention fp32 (auto: ") in notes[0]


def _prefill_notes(path: str) -> list[str]:
    """Each rank's start-up words for its prefill (its memory report), at TP 2."""
    executor = executor_for(path, 2)
    try:
        return [r["prefill"] for r in executor.reports]
    finally:
        executor.close()
