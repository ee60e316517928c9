"""FusedDecode (a decode step's whole decoder stack in one C call) against the Python path it
replaces, bit for bit, and against transformers; and every step it must leave to Python."""

from __future__ import annotations

import pytest
import torch

from native_backend.core.batch import ScheduledChunk, SchedulerOutput
from native_backend.core.sampling_params import SamplingParams
from native_backend.execution.model_runner import ModelRunner
from native_backend.model.kv_cache import KVCache
from native_backend.model.layers.linear import KERNEL_MAX_ROWS
from native_backend.model.models.fused_decode import FusedDecode
from tests.support.data.llama_checkpoints import VOCAB, make_checkpoint

torch.set_num_threads(2)
pytestmark = pytest.mark.usefixtures("c_kernels")  # skips only where the CPU cannot run them (tests/support/checks/c_kernels.py)
BLOCK_SIZE = 4


@pytest.fixture(scope="module", params=[False, True], ids=["no-bias", "qkvo-bias"])
def models(request, tmp_path_factory):
    hf, ours = make_checkpoint(tmp_path_factory.mktemp("llama"), tie=False, rope_scaling=None,
                               attention_bias=request.param)
    assert "one-call decode steps" in ours.ctx.kernels
    return hf, ours


class Counting:
    """Wraps the model's FusedDecode: how many steps it took and how many it left to Python."""

    def __init__(self, fused: FusedDecode):
        self.fused, self.taken, self.declined = fused, 0, 0

    def __call__(self, *args):
        out = self.fused(*args)
        if out is None:
            self.declined += 1
        else:
            self.taken += 1
        return out


def tokens(n, seed):
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def chunk(rid, toks, start, table):
    return ScheduledChunk(rid, list(toks), start, list(table), True, SamplingParams(temperature=0.0))


# Three sequences: prompts, then steps of single decodes and of short multi-token chunks (<= 8 rows
# each: still the kernel's rows), the cache blocks handed out scrambled.
SEQS = {"a": tokens(30, 1), "b": tokens(21, 2), "c": tokens(26, 3)}
PROMPTS = {"a": 11, "b": 5, "c": 9}
STEPS = [{"a": 1, "b": 1, "c": 1}, {"a": 3, "b": 8, "c": 1}, {"a": 1, "b": 1}, {"a": 7, "b": 2, "c": 8},
         {"a": 1, "b": 1, "c": 1}]
TABLES = {"a": [3, 17, 8, 25, 1, 30, 12, 6], "b": [9, 2, 28, 14, 21, 5], "c": [19, 11, 27, 4, 23, 15, 7]}


def key_offsets(config) -> torch.Tensor:
    """(layers, kv_heads, head_dim): a calibrated fp8 cache's keys' means (KVLayer.k_offset), made up."""
    g = torch.Generator().manual_seed(7)
    return torch.randn(config.num_layers, config.num_kv_heads, config.head_dim, generator=g) * 0.5


def run_steps(model, fused: bool, kv_dtype: str = "float32",
              k_offsets: torch.Tensor | None = None) -> list[dict[str, torch.Tensor]]:
    """Every step's logits rows per sequence (all rows of each chunk), with the model's one-call
    decode steps (counted) or without them, over a fresh cache of `kv_dtype` (its keys stored
    minus `k_offsets`[layer], if given)."""
    cache = KVCache.for_model(model.config, num_blocks=32, block_size=BLOCK_SIZE, dtype=kv_dtype)
    for i, layer in enumerate(cache.layers):  # fp8's per-layer scales (unused by other formats)
        layer.k_scale, layer.v_scale = 0.02, 0.01
        layer.k_offset = None if k_offsets is None else k_offsets[i].contiguous()
    runner = ModelRunner(model, cache)
    assert model.fused_decode is not None
    model.fused_decode = Counting(model.fused_decode) if fused else None
    pos = dict.fromkeys(SEQS, 0)
    results = []
    for step in [PROMPTS, *STEPS]:
        chunks = [chunk(r, SEQS[r][pos[r]: pos[r] + n], pos[r], TABLES[r]) for r, n in step.items()]
        results.append(runner.compute_logits(SchedulerOutput(chunks), all_tokens=True))
        for r, n in step.items():
            pos[r] += n
    return results


@pytest.mark.usefixtures("kernel_path")  # once per CPU kernel path (AVX2, AVX-512)
def test_decode_steps_are_bit_identical_to_the_python_path_and_match_hf(models):
    hf, ours = models
    fused = run_steps(ours, fused=True)
    counting = ours.fused_decode
    python = run_steps(ours, fused=False)
    assert (counting.taken, counting.declined) == (len(STEPS), 1)  # the prompt step goes to Python
    for step_fused, step_python in zip(fused, python):
        for rid in step_python:
            assert torch.equal(step_fused[rid], step_python[rid]), rid
    with torch.no_grad():
        reference = {r: hf(torch.tensor([s])).logits[0] for r, s in SEQS.items()}
    pos = dict(PROMPTS)
    for step, logits in zip(STEPS, fused[1:]):
        for r, n in step.items():
            torch.testing.assert_close(logits[r], reference[r][pos[r]: pos[r] + n], atol=1e-4, rtol=0)
            pos[r] += n


def step_inputs(model, num_rows: int, kv_cache: KVCache):
    """A decode step of num_rows sequences over `kv_cache` (bound to the model by the runner)."""
    runner = ModelRunner(model, kv_cache)
    chunks = [chunk(f"r{i}", [i % VOCAB], 3, [i]) for i in range(num_rows)]
    return runner.prepare_inputs(chunks)


def test_steps_it_cannot_take_go_back_to_python(models):
    _, ours = models
    cache = KVCache.for_model(ours.config, num_blocks=KERNEL_MAX_ROWS + 1, block_size=BLOCK_SIZE)
    inputs = step_inputs(ours, 4, cache)
    fused = ours.fused_decode
    call = lambda i: fused(i.input_ids, i.positions, i.attn_metadata)  # noqa: E731
    with torch.inference_mode():
        assert call(inputs) is not None
        assert call(step_inputs(ours, KERNEL_MAX_ROWS + 1, cache)) is None  # beyond the linear kernel
        assert fused(inputs.input_ids, inputs.positions.int(), inputs.attn_metadata) is None  # not int64
    with torch.enable_grad():
        assert call(inputs) is None  # autograd: the Python path


def test_the_table_is_built_when_a_cache_is_bound_and_only_for_float32_caches(models):
    _, ours = models
    results = []
    with torch.inference_mode():
        for _ in range(2):  # two caches with the same contents: a table each, the same answer
            cache = KVCache.for_model(ours.config, num_blocks=8, block_size=BLOCK_SIZE)
            inputs = step_inputs(ours, 3, cache)
            assert ours.fused_decode.layers[0].cache_k == cache.layer(0).key.data_ptr()
            results.append(ours.fused_decode(inputs.input_ids, inputs.positions, inputs.attn_metadata))
        assert torch.equal(results[0], results[1])
        step_inputs(ours, 2, KVCache.for_model(ours.config, num_blocks=8, block_size=BLOCK_SIZE, dtype="bfloat16"))
        assert ours.fused_decode is None  # a bf16 cache: every step through the Python path
        assert FusedDecode.build(ours) is None
        step_inputs(ours, 2, KVCache.for_model(ours.config, num_blocks=8, block_size=BLOCK_SIZE))
        assert FusedDecode.build(ours) is not None and ours.fused_decode is not None


def test_a_model_built_without_the_c_kernels_gets_no_fused_step(tmp_path):
    _, ours = make_checkpoint(tmp_path, tie=False, rope_scaling=None, cpu_kernels=False)
    step_inputs(ours, 2, KVCache.for_model(ours.config, num_blocks=8, block_size=BLOCK_SIZE))
    assert ours.fused_decode is None and "off" in ours.ctx.kernels


def test_positions_beyond_the_rotary_tables_are_refused(models):
    _, ours = models
    cache = KVCache.for_model(ours.config, num_blocks=8, block_size=BLOCK_SIZE)
    inputs = step_inputs(ours, 2, cache)
    inputs.positions[1] = ours.config.max_position_embeddings
    with torch.inference_mode(), pytest.raises(IndexError, match="rotary tables"):
        ours.fused_decode(inputs.input_ids, inputs.positions, inputs.attn_metadata)


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "int8"])
def test_quantized_caches_take_the_fused_step_bit_identical_to_the_python_path(models, kv_dtype):
    _, ours = models
    fused = run_steps(ours, fused=True, kv_dtype=kv_dtype)
    assert ours.fused_decode.taken == len(STEPS)
    python = run_steps(ours, fused=False, kv_dtype=kv_dtype)
    for step_fused, step_python in zip(fused, python):
        for rid in step_python:
            assert torch.equal(step_fused[rid], step_python[rid]), (kv_dtype, rid)


@pytest.mark.usefixtures("kernel_path")  # once per CPU kernel path (AVX2, AVX-512)
@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "fp8_e5m2", "float32"])
def test_a_key_offset_takes_the_fused_step_bit_identical_to_the_python_path(models, kv_dtype):
    """A calibrated fp8 cache stores keys minus their mean (KVLayer.k_offset): the C step subtracts
    it before the write as Attention.forward does, so its steps stay fused and bit-identical, and
    the cache holds the same bytes."""
    _, ours = models
    offsets = key_offsets(ours.config)
    fused = run_steps(ours, fused=True, kv_dtype=kv_dtype, k_offsets=offsets)
    assert (ours.fused_decode.taken, ours.fused_decode.declined) == (len(STEPS), 1)  # the prompt: Python
    fused_cache = [(a.kv.key.clone(), a.kv.value.clone()) for a in ours.attention_layers()]
    python = run_steps(ours, fused=False, kv_dtype=kv_dtype, k_offsets=offsets)
    for step_fused, step_python in zip(fused, python):
        for rid in step_python:
            assert torch.equal(step_fused[rid], step_python[rid]), (kv_dtype, rid)
    for (key, value), attn in zip(fused_cache, ours.attention_layers()):
        assert torch.equal(key.view(torch.uint8), attn.kv.key.view(torch.uint8))
        assert torch.equal(value.view(torch.uint8), attn.kv.value.view(torch.uint8))
    plain = run_steps(ours, fused=True, kv_dtype=kv_dtype)  # without the offset: other keys stored
    layer0 = ours.attention_layers()[0].kv.key
    assert not torch.equal(fused_cache[0][0].view(torch.uint8), layer0.view(torch.uint8))
    if kv_dtype == "float32":  # softmax ignores the shift: the logits barely move
        for with_offset, without in zip(fused[1:], plain[1:]):
            for rid in without:
                torch.testing.assert_close(with_offset[rid], without[rid], atol=1e-4, rtol=0)
