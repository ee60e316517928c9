"""Tensor parallelism with other number formats on SmolLM2 at TP 3 (each in its own module from
the fp32 tests: a process holds one tensor-parallel group at a time).

- int4 weights: the GGUF Q4_1 linears run packed (quantization gguf) give TP 1's logits within
  1e-4 (the int4 groups of 32 split whole: 192 of o_proj's inputs and 512 of down_proj's a rank;
  the LM head's int8 copy splits by vocabulary rows).
- int4 AWQ checkpoint (our AutoAWQ GEMM directory, made by the fast RTN path that
  test_native_awq_http.py's docstring explains): q/k/v and gate/up split their packed columns
  (whole int32 words), o and down their rows by whole groups of 64; greedy tokens at TP 3 equal
  TP 1's token for token on the four prompts (checked identical when written: the all-reduce's
  order of summation changes no argmax there).
- fp8 KV cache with calibrated scales: every rank calibrates over its own KV heads and the group
  takes each layer's largest scale, which is the single rank's scale; TP 3's greedy tokens are
  TP 1's, and its logits as close to float32's as TP 1's fp8 logits are (largest error 1.90
  against 1.85 when written).
"""

from __future__ import annotations

import pytest
import torch

from native_backend.config.engine import EngineConfig
from native_backend.execution.factory import make_executor
from native_backend.model.loader import default_gguf_path
from native_backend.process.factory import make_engine_core
from native_backend.process.output_processor import OutputProcessor
from native_backend.text.tokenizer import Tokenizer
from native_backend.tools.quantize import QuantizeOptions, quantize_model
from tests.support.checks.tensor_parallel_checks import greedy_tokens, max_difference, run_script, smollm2_prompts

pytestmark = pytest.mark.timeout(1200)


def build(tp: int, **settings):
    settings.setdefault("quantization", "gguf")
    # fp32 prefill: bf16's (prefill_matmul auto, on a CPU with AVX512_BF16 or AMX) would round each
    # rank's partial sums before the all-reduce, and these tests hold ranks to one rank within 1e-4
    settings.setdefault("prefill_matmul", "fp32")
    return make_executor(EngineConfig.build(path=default_gguf_path(), num_threads=1, tensor_parallel_size=tp,
                                            kv_cache_bytes=64 << 20, **settings))


def test_gguf_int4_linears_split_across_three_ranks_match_one_rank(tmp_path):
    torch.set_num_threads(1)
    prompts = smollm2_prompts(Tokenizer.from_pretrained(default_gguf_path(), cache_dir=tmp_path))[:2]
    one = build(1)
    logits_1, fed = run_script(one, prompts, 8)
    three = build(3)
    try:
        logits_3, _ = run_script(three, prompts, 8, feed=fed)
        assert "linears int4 GGUF Q4_1" in three.describe()
    finally:
        three.close()
    assert max_difference(logits_3, logits_1) < 1e-4


def test_awq_int4_checkpoint_on_three_ranks_gives_one_ranks_greedy_tokens(tmp_path):
    torch.set_num_threads(1)
    awq = str(tmp_path / "smollm2-int4-g64")
    quantize_model(default_gguf_path(), awq, QuantizeOptions(method="rtn", group_size=64))  # the format, fast
    prompts = smollm2_prompts(Tokenizer.from_pretrained(awq, cache_dir=tmp_path))

    def engine(tp: int) -> OutputProcessor:
        # fp32 prefill: bf16's would round each rank's partial sums before the all-reduce (prefill_matmul)
        return make_engine_core(EngineConfig.build(path=awq, tokenizer_cache_dir=str(tmp_path), num_threads=1,
                                            tensor_parallel_size=tp, kv_cache_bytes=64 << 20, max_num_seqs=8,
                                            prefill_matmul="fp32"))

    one = engine(1)
    expected = greedy_tokens(one, prompts, 32)
    one.core.executor.close()
    three = engine(3)
    try:
        got = greedy_tokens(three, prompts, 32)
        line, weights = three.describe(), three.stats().weights
    finally:
        three.core.executor.close()
    assert got == expected
    assert len({tuple(t) for t in got}) == len(prompts)  # four different continuations, not one stuck token
    assert weights == "int4 AWQ g64" and "linears int4 AWQ g64" in line
    assert "3 tensor-parallel ranks" in line


def test_fp8_kv_scales_calibrated_on_three_ranks_equal_one_ranks(tmp_path):
    torch.set_num_threads(1)
    prompts = smollm2_prompts(Tokenizer.from_pretrained(default_gguf_path(), cache_dir=tmp_path))[:2]
    fp8 = dict(quantization="none", kv_cache_dtype="fp8_e4m3", kv_scales="calibrate", tokenizer_cache_dir=str(tmp_path))
    one = build(1, **fp8)
    logits_1, fed = run_script(one, prompts, 8)
    three = build(3, **fp8)
    try:
        logits_3, fed_3 = run_script(three, prompts, 8)  # its own greedy tokens, not TP 1's fed to it
        scales_3 = [s for layer in three.rank.kv_cache.layers for s in (layer.k_scale, layer.v_scale)]
    finally:
        three.close()
    scales_1 = [s for layer in one.kv_cache.layers for s in (layer.k_scale, layer.v_scale)]
    assert scales_3 == pytest.approx(scales_1, rel=1e-5)
    assert fed_3 == fed  # TP 3 answers TP 1's tokens, so both saw the same inputs at every step
    # Not within 1e-5 of TP 1 as float caches are: a K or V value a rounding error away from an fp8
    # rounding edge lands one e4m3 step (1/8) away. So: as close to float32 as TP 1's fp8 is.
    exact, _ = run_script(build(1, quantization="none"), prompts, 8, feed=fed)
    error_1, error_3 = max_difference(logits_1, exact), max_difference(logits_3, exact)
    print(f"fp8 KV, largest logit error against float32: TP 1 {error_1:.3f}, TP 3 {error_3:.3f}")
    assert error_3 < 1.5 * error_1
