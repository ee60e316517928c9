"""One-call decode steps (models/fused_decode.py, csrc/decode_step.c) over int4 AWQ linears: the
step calls the int4 C kernel with the packed tensors, and every step's logits are bit-identical to
the per-layer int4 path's, over float32 and quantized KV caches; greedy tokens of the default model
quantized to int4 are the same token for token."""

from __future__ import annotations

import pydoc_data.topics
import pytest
import torch

from native_backend.core.batch import ScheduledChunk, SchedulerOutput
from native_backend.core.sampling_params import SamplingParams
from native_backend.execution.model_runner import ModelRunner
from native_backend.model.kv_cache import KVCache
from native_backend.model.layers.context import LayerContext
from native_backend.model.loader import default_gguf_path, load_hf_model
from native_backend.model.quantization.method import AWQLinearMethod
from native_backend.text.tokenizer import Tokenizer
from native_backend.tools.quantize import QuantizeOptions, quantize_model
from tests.support.data.llama_checkpoints import VOCAB, make_checkpoint

torch.set_num_threads(2)
pytestmark = [pytest.mark.usefixtures("int4_kernel"), pytest.mark.timeout(900)]  # tests/support/checks/c_kernels.py
GROUP, BLOCK = 16, 4


@pytest.fixture(scope="module", params=[False, True], ids=["no-bias", "qkvo-bias"])
def int4_model(request, tmp_path_factory):
    src, out = tmp_path_factory.mktemp("float"), tmp_path_factory.mktemp("rtn")
    make_checkpoint(src, tie=False, rope_scaling=None, attention_bias=request.param)
    quantize_model(str(src), str(out), QuantizeOptions(method="rtn", group_size=GROUP))
    return load_hf_model(str(out), LayerContext.for_device("cpu", torch.float32))


class Counting:
    """Wraps a model's FusedDecode: how many steps it took and how many it left to Python."""

    def __init__(self, fused):
        self.fused, self.taken, self.declined = fused, 0, 0

    def __call__(self, *args):
        out = self.fused(*args)
        self.taken, self.declined = self.taken + (out is not None), self.declined + (out is None)
        return out


def chunk(rid, toks, start, table):
    return ScheduledChunk(rid, list(toks), start, list(table), True, SamplingParams(temperature=0.0))


def tokens(n, seed):
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# Prompts, then decodes and short multi-token chunks (verification-sized), blocks scrambled.
SEQS = {"a": tokens(30, 1), "b": tokens(21, 2), "c": tokens(26, 3)}
STEPS = [{"a": 11, "b": 5, "c": 9}, {"a": 1, "b": 1, "c": 1}, {"a": 3, "b": 8, "c": 1}, {"a": 1, "b": 1},
         {"a": 7, "b": 2, "c": 8}, {"a": 1, "b": 1, "c": 1}]
TABLES = {"a": [3, 17, 8, 25, 1, 30, 12, 6], "b": [9, 2, 28, 14, 21, 5], "c": [19, 11, 27, 4, 23, 15, 7]}


def run_steps(model, fused: bool, kv_dtype: str) -> list[dict[str, torch.Tensor]]:
    cache = KVCache.for_model(model.config, num_blocks=32, block_size=BLOCK, dtype=kv_dtype)
    for layer in cache.layers:
        layer.k_scale, layer.v_scale = 0.02, 0.01  # fp8's scales (unused by other formats)
    runner = ModelRunner(model, cache)
    assert model.fused_decode is not None  # built at binding for the int4 model
    model.fused_decode = Counting(model.fused_decode) if fused else None
    pos = dict.fromkeys(SEQS, 0)
    results = []
    for step in STEPS:
        chunks = [chunk(r, SEQS[r][pos[r]: pos[r] + n], pos[r], TABLES[r]) for r, n in step.items()]
        results.append(runner.compute_logits(SchedulerOutput(chunks), all_tokens=True))
        for r, n in step.items():
            pos[r] += n
    return results


def test_the_int4_model_keeps_the_one_call_step_and_its_table_holds_the_packed_tensors(int4_model):
    assert "one-call decode steps" in int4_model.ctx.kernels and int4_model.ctx.fuse_decode
    ModelRunner(int4_model, KVCache.for_model(int4_model.config, num_blocks=8, block_size=BLOCK))
    entry, proj = int4_model.fused_decode.layers[1], int4_model.model.layers[1].mlp.down_proj
    assert isinstance(proj.method, AWQLinearMethod)
    assert entry.down.w is None and entry.down.qweight == proj.qweight.data_ptr()
    assert (entry.down.scales, entry.down.group, entry.down.k, entry.down.n) == (
        proj.scales.data_ptr(), GROUP, 112, 64)


@pytest.mark.parametrize("kv_dtype", ["float32", "int8"])
def test_fused_int4_steps_are_bit_identical_to_the_per_layer_int4_path(int4_model, kv_dtype):
    fused = run_steps(int4_model, fused=True, kv_dtype=kv_dtype)
    counting = int4_model.fused_decode
    assert (counting.taken, counting.declined) == (len(STEPS) - 1, 1)  # the prompt step goes to Python
    python = run_steps(int4_model, fused=False, kv_dtype=kv_dtype)
    for step_fused, step_python in zip(fused, python):
        for rid in step_python:
            assert torch.equal(step_fused[rid], step_python[rid]), rid


def test_an_int4_model_without_the_c_kernels_gets_no_fused_step(tmp_path):
    src, out = tmp_path / "float", tmp_path / "rtn"
    make_checkpoint(src, tie=False, rope_scaling=None)
    quantize_model(str(src), str(out), QuantizeOptions(method="rtn", group_size=GROUP))
    model = load_hf_model(str(out), LayerContext.for_device("cpu", torch.float32, cpu_kernels=False))
    ModelRunner(model, KVCache.for_model(model.config, num_blocks=8, block_size=BLOCK))
    assert model.fused_decode is None and "one-call" not in model.ctx.kernels


# ------------------------------------------------------------------------------ the default model


@pytest.fixture(scope="module")
def smollm2_int4(tmp_path_factory):
    """(the default model quantized RTN g64 and loaded with the C kernels, its tokenizer)"""
    out = tmp_path_factory.mktemp("smollm2-rtn")
    quantize_model(default_gguf_path(), str(out), QuantizeOptions(method="rtn", group_size=64))
    return load_hf_model(str(out), LayerContext.for_device("cpu", torch.float32)), Tokenizer.from_pretrained(out)


def greedy(model, prompts: dict[str, list[int]], n: int, fused: bool) -> dict[str, list[int]]:
    """Greedy tokens of a batch of prompts, n each, decoding with or without the one-call step."""
    cache = KVCache.for_model(model.config, num_blocks=64, block_size=16)
    runner = ModelRunner(model, cache)
    assert model.fused_decode is not None
    if not fused:
        model.fused_decode = None
    tables = {r: list(range(i * 16, (i + 1) * 16)) for i, r in enumerate(prompts)}
    seqs = {r: list(p) for r, p in prompts.items()}
    logits = runner.compute_logits(SchedulerOutput([chunk(r, p, 0, tables[r]) for r, p in seqs.items()]))
    for _ in range(n):
        for r in seqs:
            seqs[r].append(int(logits[r][-1].argmax()))
        logits = runner.compute_logits(SchedulerOutput(
            [chunk(r, s[-1:], len(s) - 1, tables[r]) for r, s in seqs.items()]))
    return {r: s[len(prompts[r]):] for r, s in seqs.items()}


def test_default_model_int4_greedy_tokens_fused_equal_per_layer(smollm2_int4):
    model, tokenizer = smollm2_int4
    texts = list(pydoc_data.topics.topics.values())[40:43]
    prompts = {r: tokenizer.encode(t)[:n] for r, t, n in zip("abc", texts, (17, 40, 29))}
    fused = greedy(model, prompts, 24, fused=True)
    per_layer = greedy(model, prompts, 24, fused=False)
    assert fused == per_layer
    assert len({tuple(t) for t in fused.values()}) == 3  # three continuations, not one stuck token
