"""Our paged Llama against transformers' LlamaForCausalLM on tiny random checkpoints (fp32).

transformers sees each whole sequence at once; we feed the same tokens through the runner in
steps (prefill, chunks, decodes, shared prefix blocks) and compare every logits row.
"""

from __future__ import annotations

import json

import pytest
import torch

from native_backend.core.batch import ScheduledChunk, SchedulerOutput
from native_backend.core.sampling_params import SamplingParams
from native_backend.execution.model_runner import ModelRunner
from native_backend.model.kv_cache import KVCache
from native_backend.model.loader import load_hf_model
from native_backend.model.models import LlamaForCausalLM
from tests.support.data.llama_checkpoints import VOCAB, make_checkpoint

torch.set_num_threads(2)
ATOL = 1e-4
BLOCK_SIZE = 4

LLAMA3_SCALING = {
    "rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}


@pytest.fixture(scope="module", params=[(False, None, True), (True, LLAMA3_SCALING, True), (False, None, False)],
                ids=["untied-rope", "tied-llama3", "untied-rope-torch-only"])
def models(request, tmp_path_factory):
    """The C kernels (decode attention, small-batch linears) where they build, and torch alone."""
    tie, scaling, cpu_kernels = request.param
    hf, ours = make_checkpoint(tmp_path_factory.mktemp("llama"), tie=tie, rope_scaling=scaling, cpu_kernels=cpu_kernels)
    return hf, ours


def hf_logits(hf, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([token_ids])).logits[0].float()  # (seq_len, vocab)


class Blocks:
    """A stand-in block manager: hands out block ids in a scrambled order."""

    def __init__(self, num_blocks: int):
        self.free = list(torch.randperm(num_blocks, generator=torch.Generator().manual_seed(1)).tolist())

    def table_for(self, table: list[int], num_tokens: int) -> list[int]:
        while len(table) * BLOCK_SIZE < num_tokens:
            table.append(self.free.pop())
        return table


def make_runner(model, num_blocks=64):
    cache = KVCache.for_model(model.config, num_blocks=num_blocks, block_size=BLOCK_SIZE)
    return ModelRunner(model, cache)


def chunk(rid, tokens, start, table, sample=True):
    return ScheduledChunk(rid, list(tokens), start, list(table), sample, SamplingParams(temperature=0.0))


def rand_tokens(n, seed):
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_config_read_from_checkpoint(models):
    hf, ours = models
    assert ours.config.num_kv_heads == 2 and ours.config.head_dim == 16
    assert ours.config.tie_word_embeddings == hf.config.tie_word_embeddings
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == hf.config.tie_word_embeddings


def test_prefill_and_every_decode_step_match_hf_in_a_mixed_batch(models):
    """A prefills then decodes; B joins later with a chunked prompt, sharing steps with A."""
    hf, ours = models
    runner, blocks = make_runner(ours), Blocks(64)
    seq_a, seq_b = rand_tokens(17, seed=2), rand_tokens(15, seed=3)
    ref_a, ref_b = hf_logits(hf, seq_a), hf_logits(hf, seq_b)
    table_a, table_b = [], []
    # (tokens of A this step, tokens of B this step): A prompt 11 then decodes; B chunks 4+5 then decodes.
    steps = [((0, 11), None), ((11, 12), (0, 4)), ((12, 13), (4, 9)), ((13, 14), (9, 10)), ((14, 17), (10, 15))]
    for a_span, b_span in steps:
        chunks = [chunk("a", seq_a[slice(*a_span)], a_span[0], blocks.table_for(table_a, a_span[1]))]
        if b_span:
            chunks.append(chunk("b", seq_b[slice(*b_span)], b_span[0], blocks.table_for(table_b, b_span[1])))
        logits = runner.compute_logits(SchedulerOutput(chunks), all_tokens=True)
        torch.testing.assert_close(logits["a"], ref_a[slice(*a_span)], atol=ATOL, rtol=0)
        if b_span:
            torch.testing.assert_close(logits["b"], ref_b[slice(*b_span)], atol=ATOL, rtol=0)


def test_pure_decode_batch_matches_hf(models):
    """After both prompts are cached, a step of only decodes takes the batched decode path."""
    hf, ours = models
    runner, blocks = make_runner(ours), Blocks(64)
    seqs = {"a": rand_tokens(10, 4), "b": rand_tokens(6, 5), "c": rand_tokens(13, 6)}
    tables = {rid: blocks.table_for([], len(s)) for rid, s in seqs.items()}
    runner.compute_logits(SchedulerOutput([chunk(r, s[:-1], 0, tables[r]) for r, s in seqs.items()]))
    logits = runner.compute_logits(SchedulerOutput([chunk(r, s[-1:], len(s) - 1, tables[r]) for r, s in seqs.items()]))
    for rid, s in seqs.items():
        torch.testing.assert_close(logits[rid][0], hf_logits(hf, s)[-1], atol=ATOL, rtol=0)


def test_prefix_reuse_reads_the_shared_blocks(models):
    """B's table starts with A's two full blocks; B computes only its suffix from start_pos=8."""
    hf, ours = models
    runner, blocks = make_runner(ours), Blocks(64)
    seq_a = rand_tokens(10, seed=7)
    seq_b = seq_a[:8] + rand_tokens(5, seed=8)
    table_a = blocks.table_for([], len(seq_a))
    runner.compute_logits(SchedulerOutput([chunk("a", seq_a, 0, table_a)]))
    table_b = blocks.table_for(table_a[:2], len(seq_b))  # shares positions 0..7
    logits = runner.compute_logits(SchedulerOutput([chunk("b", seq_b[8:], 8, table_b)]), all_tokens=True)
    torch.testing.assert_close(logits["b"], hf_logits(hf, seq_b)[8:], atol=ATOL, rtol=0)


def test_execute_samples_only_chunks_that_ask(models):
    hf, ours = models
    runner, blocks = make_runner(ours), Blocks(64)
    prompt = rand_tokens(9, seed=9)
    table = blocks.table_for([], 9)
    first = runner.execute(SchedulerOutput([chunk("a", prompt[:5], 0, table, sample=False)]))
    assert first.sampled_token_ids == {}
    out = runner.execute(SchedulerOutput([chunk("a", prompt[5:], 5, table)]))
    assert out.sampled_token_ids == {"a": [int(hf_logits(hf, prompt)[-1].argmax())]}


def test_linear_rope_scaling_matches_hf(tmp_path):
    hf, ours = make_checkpoint(tmp_path, tie=False, rope_scaling={"rope_type": "linear", "factor": 2.0})
    runner = make_runner(ours)
    seq = rand_tokens(12, seed=10)
    logits = runner.compute_logits(SchedulerOutput([chunk("a", seq, 0, Blocks(64).table_for([], 12))]), all_tokens=True)
    torch.testing.assert_close(logits["a"], hf_logits(hf, seq), atol=ATOL, rtol=0)


def test_the_class_comes_from_the_checkpoints_architecture(tmp_path):
    """config.json's model_type picks the class from the registry; one it does not know is refused
    by name, with the architectures it runs, before a weight is read."""
    _, ours = make_checkpoint(tmp_path, tie=False, rope_scaling=None)
    assert ours.config.architecture == "llama" and type(ours) is LlamaForCausalLM
    config_file = tmp_path / "config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, "model_type": "mistral"}))
    mistral = load_hf_model(str(tmp_path))
    assert mistral.config.architecture == "mistral" and type(mistral) is LlamaForCausalLM
    config_file.write_text(json.dumps({**config, "model_type": "qwen2"}))
    with pytest.raises(NotImplementedError, match=r"architecture 'qwen2' is not supported; this engine runs llama, mistral"):
        load_hf_model(str(tmp_path))
