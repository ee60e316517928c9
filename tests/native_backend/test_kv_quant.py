"""Quantized KV caches (fp8 e4m3 / e5m2 per layer, int8 per token and head): the torch reference
is the specification; the C kernels write the same bytes and read the same values."""

from __future__ import annotations

import pytest
import torch

from native_backend.kernels import cpu_kernels
from native_backend.model.attention import cpu, kv_quant, reference
from native_backend.model.attention.metadata import AttentionMetadata
from native_backend.model.kv_cache import KVCache, KVLayer, kv_bytes_per_token, plan_kv_cache, resolve_kv_dtype
from tests.support.data.attention_cases import dense

torch.set_num_threads(2)
QUANTIZED = ["fp8_e4m3", "fp8_e5m2", "int8"]
needs_kernels = pytest.mark.usefixtures("c_kernels")  # skips only where the CPU cannot run them (tests/support/checks/c_kernels.py)
# Relative RMS error of a write-then-read round trip on Gaussian K/V: what each format costs.
ROUND_TRIP_RMS = {"fp8_e4m3": 0.04, "fp8_e5m2": 0.08, "int8": 0.01}


def randn(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def tricky_values(n: int, seed: int) -> torch.Tensor:
    """Gaussian values of many magnitudes, plus exact halfway points between fp8 neighbours (where
    rounding to nearest even decides), zeros, and values beyond the formats' range."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-12, 12, (n,), generator=g).float())
    for storage in (torch.float8_e4m3fn, torch.float8_e5m2):
        grid = kv_quant.fp8_lut(storage)
        grid = grid[torch.isfinite(grid)].unique()
        x = torch.cat([x, (grid[1:] + grid[:-1]) / 2, grid])
    return torch.cat([x, torch.tensor([0.0, -0.0, 1e6, -1e6, 1e-30])])


def layer_scales(dtype: str) -> dict:
    return {"k_scale": 0.05, "v_scale": 0.02} if dtype.startswith("fp8") else {}


def filled_layer(dtype, *, num_blocks, block_size, kv_heads, head_dim, k, v, slots, **scales) -> KVLayer:
    layer = KVLayer.allocate(num_blocks=num_blocks, block_size=block_size, num_kv_heads=kv_heads, head_dim=head_dim,
                             dtype=dtype)
    for name, value in scales.items():
        setattr(layer, name, value)
    reference.write_kv(k, v, layer, slots)
    return layer


@pytest.mark.parametrize("storage", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_reference_fp8_is_torchs_cast_of_the_clamped_ratio(storage):
    dtype = resolve_kv_dtype(storage)
    x = tricky_values(4000, seed=1)
    x = x[: x.numel() // 8 * 8].reshape(-1, 1, 8)
    stored, scales = kv_quant.quantize(x, dtype, 0.5)
    assert scales is None and stored.dtype == storage
    assert torch.equal(stored.view(torch.uint8), (x / 0.5).clamp(-dtype.max_value, dtype.max_value).to(storage).view(torch.uint8))
    back = kv_quant.dequantize(stored, None, dtype, 0.5, torch.float32)
    assert torch.isfinite(back).all() and back.abs().max() <= dtype.max_value * 0.5


def test_reference_int8_keeps_one_scale_per_token_and_head():
    dtype = resolve_kv_dtype("int8")
    x = randn(5, 3, 64, seed=2)
    x[1, 2] = 0.0  # an all-zero head: scale 0, values 0
    stored, scales = kv_quant.quantize(x, dtype, 1.0)
    assert stored.dtype == torch.int8 and scales.shape == (5, 3)
    assert torch.equal(scales, x.abs().amax(-1) / 127) and stored.abs().max() == 127
    assert (stored[1, 2] == 0).all() and scales[1, 2] == 0
    back = kv_quant.dequantize(stored, scales, dtype, 1.0, torch.float32)
    assert ((back - x).abs() <= scales[..., None] / 2 + 1e-6).all()  # within half a step


@pytest.mark.parametrize("dtype", QUANTIZED)
def test_round_trip_error_per_format(dtype):
    k = randn(512, 3, 64, seed=3)
    scales = {"k_scale": float(k.abs().max()) / 448 * 1.2} if dtype == "fp8_e4m3" else {}
    if dtype == "fp8_e5m2":
        scales = {"k_scale": float(k.abs().max()) / 57344 * 1.2}
    layer = filled_layer(dtype, num_blocks=32, block_size=16, kv_heads=3, head_dim=64, k=k, v=k,
                         slots=torch.arange(512), **scales)
    back = reference.read_blocks(layer, "k", torch.arange(32), torch.float32).reshape(512, 3, 64)
    rms = float(((back - k) ** 2).mean().sqrt() / (k**2).mean().sqrt())
    assert 0 < rms < ROUND_TRIP_RMS[dtype], rms


@pytest.mark.usefixtures("kernel_path")  # once per CPU kernel path (AVX2, AVX-512)
@needs_kernels
@pytest.mark.parametrize("dtype", QUANTIZED)
def test_c_write_is_bit_identical_to_the_reference(dtype):
    values = tricky_values(6000, seed=4)
    n = values.numel() // (2 * 32) * 2 * 32
    k, v = values[: n // 2].reshape(-1, 2, 16), values[n // 2: n].reshape(-1, 2, 16) * 0.1
    tokens = k.shape[0]
    slots = torch.randperm(tokens + 40, generator=torch.Generator().manual_seed(5))[:tokens]
    shape = dict(num_blocks=-(-(tokens + 40) // 8), block_size=8, kv_heads=2, head_dim=16, **layer_scales(dtype))
    ref = filled_layer(dtype, k=k, v=v, slots=slots, **shape)
    ours = KVLayer.allocate(num_blocks=shape["num_blocks"], block_size=8, num_kv_heads=2, head_dim=16, dtype=dtype)
    ours.k_scale, ours.v_scale = ref.k_scale, ref.v_scale
    cpu.write_kv(k, v, ours, slots)
    for a, b in ((ref.key, ours.key), (ref.value, ours.value)):
        assert torch.equal(kv_quant.as_bytes(a), kv_quant.as_bytes(b))
    if dtype == "int8":
        assert torch.equal(ref.key_scales, ours.key_scales) and torch.equal(ref.value_scales, ours.value_scales)
    else:  # both count, per side and KV head, the values beyond the range that they clamp
        fmt = resolve_kv_dtype(dtype)
        expected = [((x / s).abs() > fmt.max_value).sum(dim=(0, 2)).tolist() for x, s in ((k, ref.k_scale), (v, ref.v_scale))]
        assert ref.clamped.tolist() == ours.clamped.tolist() == expected
        assert sum(expected[0]) > 0  # tricky_values holds values beyond the range


def test_fp8_clamp_counts_add_up_across_writes_and_reach_the_totals():
    from native_backend.execution.kv_scales import clamp_report, clamped_totals

    cache = KVCache(num_layers=2, num_blocks=4, block_size=4, num_kv_heads=2, head_dim=8, dtype="fp8_e4m3")
    layer = cache.layer(1)
    layer.k_scale = layer.v_scale = 1.0
    k, v = torch.zeros(3, 2, 8), torch.zeros(3, 2, 8)
    k[0, 1, :3], v[2, 0, 0] = 500.0, -449.0  # beyond e4m3's 448; 448 itself is in range
    k[1, 0, 0] = 448.0
    for _ in range(2):
        reference.write_kv(k, v, layer, torch.tensor([0, 1, 2]))
    assert clamp_report(cache) == [([0, 0], [0, 0]), ([0, 6], [2, 0])]
    assert clamped_totals(cache) == (6, 2)
    assert clamped_totals(KVCache(num_layers=1, num_blocks=2, block_size=4, num_kv_heads=2, head_dim=8,
                                  dtype="int8")) == (0, 0)


def quantized_case(dtype, seqs, *, kv_heads=3, group=3, head_dim=64, block_size=16, seed=6):
    """A scrambled paged cache in `dtype` holding every key of a few sequences; the step's q and
    metadata; and the dense K/V as the cache holds them (dequantized), for the exact answer."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-ctx // block_size) for ctx, _ in seqs) + 4
    free = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    tables = [[free.pop() for _ in range(-(-ctx // block_size))] for ctx, _ in seqs]
    ctxs, q_lens = [c for c, _ in seqs], [q for _, q in seqs]
    full = AttentionMetadata.build(query_lens=ctxs, context_lens=ctxs, block_tables=tables, block_size=block_size)
    k = torch.randn(sum(ctxs), kv_heads, head_dim, generator=g)
    v = torch.randn(sum(ctxs), kv_heads, head_dim, generator=g)
    layer = filled_layer(dtype, num_blocks=num_blocks, block_size=block_size, kv_heads=kv_heads, head_dim=head_dim,
                         k=k, v=v, slots=full.slot_mapping, **layer_scales(dtype))
    md = AttentionMetadata.build(query_lens=q_lens, context_lens=ctxs, block_tables=tables, block_size=block_size)
    ks, vs = [], []
    for table, ctx in zip(tables, ctxs):
        ids = torch.tensor(table)
        ks.append(reference.read_blocks(layer, "k", ids, torch.float32).flatten(0, 1)[:ctx])
        vs.append(reference.read_blocks(layer, "v", ids, torch.float32).flatten(0, 1)[:ctx])
    q = torch.randn(sum(q_lens), kv_heads * group, head_dim, generator=g)
    return q, ks, vs, layer, md


CASES = [[(37, 1), (70, 1), (5, 1)], [(40, 40), (33, 1), (90, 3), (17, 17)]]


@pytest.mark.parametrize("dtype", QUANTIZED)
@pytest.mark.parametrize("seqs", CASES, ids=["decode", "mixed"])
def test_reference_attends_over_the_dequantized_cache(dtype, seqs):
    q, ks, vs, layer, md = quantized_case(dtype, seqs)
    got = reference.paged_attention(q, layer, md, 0.125)
    torch.testing.assert_close(got, dense(q, ks, vs, md, 0.125), atol=2e-5, rtol=1e-5)
    spec = reference.paged_attention_per_sequence(q, layer, md, 0.125)
    torch.testing.assert_close(got, spec, atol=2e-5, rtol=1e-5)


@pytest.mark.usefixtures("kernel_path")  # once per CPU kernel path (AVX2, AVX-512)
@needs_kernels
@pytest.mark.parametrize("dtype", QUANTIZED)
@pytest.mark.parametrize("seqs", CASES, ids=["decode", "mixed"])
def test_c_kernels_read_what_the_reference_reads(dtype, seqs):
    q, ks, vs, layer, md = quantized_case(dtype, seqs)
    got = cpu.paged_attention(q, layer, md, 0.125)
    torch.testing.assert_close(got, reference.paged_attention(q, layer, md, 0.125), atol=2e-5, rtol=1e-5)


@pytest.mark.usefixtures("kernel_path")  # once per CPU kernel path (AVX2, AVX-512)
@needs_kernels
def test_c_decode_over_many_chunks_merges_exactly():
    q, ks, vs, layer, md = quantized_case("int8", [(300, 1), (129, 1)], kv_heads=1, group=2, head_dim=32)
    plan = cpu.step_plan(md, torch.float32, q.device)
    for chunk_blocks in (1, 3, 64):
        got = cpu_kernels.paged_decode_q(q, cpu.quantized_view(layer), md.block_tables, plan.row_seq, plan.row_keys,
                                         0.2, chunk_blocks=chunk_blocks)
        torch.testing.assert_close(got, dense(q, ks, vs, md, 0.2), atol=2e-5, rtol=1e-5)


@needs_kernels
def test_c_kernels_refuse_what_they_cannot_read():
    layer = KVLayer.allocate(num_blocks=4, block_size=4, num_kv_heads=1, head_dim=8, dtype="int8")
    bad = cpu.quantized_view(layer)
    bad.key_scales = None
    with pytest.raises(ValueError, match="int8 needs its row scales"):
        cpu_kernels.write_kv_q(randn(1, 1, 8), randn(1, 1, 8), bad, torch.tensor([0]))


def test_block_bytes_count_the_dtype_and_the_scales():
    smollm2 = dict(num_layers=30, num_kv_heads=3, head_dim=64)
    budget = dict(block_size=16, max_model_len=2048, kv_cache_bytes=96 << 20)
    plans = {}
    for name in ("float32", "fp8_e4m3", "int8"):
        d = resolve_kv_dtype(name)
        plans[name] = plan_kv_cache(**smollm2, bytes_per_element=d.bytes_per_element,
                                    scale_bytes_per_head=d.scale_bytes_per_head, **budget)
    # fp8: a block is exactly a quarter of fp32's (no scales), so 4x the blocks up to the rounding
    assert plans["fp8_e4m3"].bytes_per_block * 4 == plans["float32"].bytes_per_block
    assert 0 <= plans["fp8_e4m3"].num_blocks - 4 * plans["float32"].num_blocks < 4
    assert 3.7 * plans["float32"].num_blocks < plans["int8"].num_blocks < 4 * plans["float32"].num_blocks
    assert plans["int8"].bytes_per_token == kv_bytes_per_token(**smollm2, bytes_per_element=1, scale_bytes_per_head=4)
    cache = KVCache(num_layers=2, num_blocks=3, block_size=16, num_kv_heads=3, head_dim=64, dtype="int8")
    assert cache.nbytes == 3 * 16 * kv_bytes_per_token(2, 3, 64, 1, 4)


# ------------------------------------------------------------------------------ Triton, interpreted

TRITON_CASES = {"decode": [(13, 1), (6, 1)], "mixed": [(9, 9), (12, 3), (5, 1)]}


def triton_checks() -> list[str]:
    """Run in a subprocess with TRITON_INTERPRET=1: the Triton write is bit-identical to the
    reference's, and its attention reads what the reference reads."""
    from native_backend.model.attention import get_attention_backend

    triton_backend = get_attention_backend("cpu", "triton")
    lines = []
    for dtype in QUANTIZED:
        for name, seqs in TRITON_CASES.items():
            q, _, _, layer, md = quantized_case(dtype, seqs, kv_heads=2, group=2, head_dim=16, block_size=4)
            k_new, v_new = randn(md.slot_mapping.numel(), 2, 16, seed=7), randn(md.slot_mapping.numel(), 2, 16, seed=8)
            k_new[0, 1, 3] = 1e4  # beyond either fp8 format's range at k_scale 0.05: one clamp, K row, head 1
            copies = {}
            for impl in ("reference", "triton"):
                copy = KVLayer(layer.key.clone(), layer.value.clone(), layer.dtype, layer.k_scale, layer.v_scale,
                               key_scales=None if layer.key_scales is None else layer.key_scales.clone(),
                               value_scales=None if layer.value_scales is None else layer.value_scales.clone(),
                               clamped=None if layer.clamped is None else torch.zeros_like(layer.clamped))
                (reference if impl == "reference" else triton_backend).write_kv(k_new, v_new, copy, md.slot_mapping)
                copies[impl] = copy
            ref, tri = copies["reference"], copies["triton"]
            same = all(torch.equal(kv_quant.as_bytes(a), kv_quant.as_bytes(b)) for a, b in
                       ((ref.key, tri.key), (ref.value, tri.value)))
            if dtype == "int8":
                same = same and torch.equal(ref.key_scales, tri.key_scales) and torch.equal(ref.value_scales, tri.value_scales)
            else:
                same = same and ref.clamped.tolist() == tri.clamped.tolist() == [[0, 1], [0, 0]]
            assert same, f"{dtype} {name}: write_kv differs"
            err = (triton_backend.paged_attention(q, tri, md, 0.25) - reference.paged_attention(q, ref, md, 0.25)).abs().max()
            assert err < 1e-4, f"{dtype} {name}: max abs error {err}"
            lines.append(f"{dtype} {name}: ok (max abs error {err:.2e})")
    return lines


def test_triton_kernels_match_the_reference_under_interpreter():
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([root, os.path.join(root, "tests")])}
    proc = subprocess.run([sys.executable, os.path.abspath(__file__)], env=env, cwd=root, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count(": ok") == len(QUANTIZED) * len(TRITON_CASES), proc.stdout


if __name__ == "__main__":
    print("\n".join(triton_checks()))


def test_fp8_calibration_starts_with_chat_turns_and_holds_no_evaluated_prompt(tmp_path):
    import sys
    from pathlib import Path

    from native_backend.execution.kv_scales import CALIBRATION_TOKENS, calibration_ids
    from native_backend.model.loader import default_gguf_path
    from native_backend.text.tokenizer import Tokenizer

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    from kv_quant import CHAT_PROMPTS  # the chat battery accuracy is judged on

    tokenizer = Tokenizer.from_pretrained(default_gguf_path(), cache_dir=str(tmp_path))
    ids = calibration_ids(tokenizer)
    text = tokenizer.decode(ids, skip_special_tokens=False)
    assert len(ids) == CALIBRATION_TOKENS
    assert text.startswith("<|im_start|>system") and text.count("<|im_start|>assistant") == 5
    assert "command-line" in text.lower()  # then the docstrings (argparse first)
    assert not any(q in text for q in CHAT_PROMPTS)


def test_a_key_offset_leaves_the_model_s_logits_as_they_were(tmp_path):
    """Keys stored minus a per-layer, per-head offset (KVLayer.k_offset: fp8's calibrated mean,
    subtracted in Attention.forward for every cache dtype) move every score of a query by the same
    amount, which softmax ignores: a prompt and a decode step give the logits they give without
    it (a float32 cache, so that only the shift differs)."""
    from native_backend.core.batch import ScheduledChunk, SchedulerOutput
    from native_backend.core.sampling_params import SamplingParams
    from native_backend.execution.model_runner import ModelRunner
    from tests.support.data.llama_checkpoints import make_checkpoint

    _, model = make_checkpoint(tmp_path, tie=True, rope_scaling=None)
    prompt, greedy = list(range(3, 23)), SamplingParams(temperature=0.0)

    def run(offsets: torch.Tensor | None) -> tuple[list[torch.Tensor], KVCache]:
        cache = KVCache.for_model(model.config, num_blocks=4, block_size=16, dtype="float32")
        for i, layer in enumerate(cache.layers):
            layer.k_offset = None if offsets is None else offsets[i]
        runner = ModelRunner(model, cache)
        steps = [ScheduledChunk("s", prompt, 0, [1, 2], True, greedy), ScheduledChunk("s", [7], 20, [1, 2], True, greedy)]
        return [runner.compute_logits(SchedulerOutput([step]))["s"] for step in steps], cache

    config = model.config
    offsets = randn(config.num_layers, config.num_kv_heads, config.head_dim, seed=5, scale=3.0)
    (plain, plain_cache), (shifted, shifted_cache) = run(None), run(offsets)
    for i, (a, b) in enumerate(zip(plain_cache.layers, shifted_cache.layers)):  # the keys are stored shifted...
        torch.testing.assert_close(b.key[1:3].flatten(0, 1)[:21], a.key[1:3].flatten(0, 1)[:21] - offsets[i])
        torch.testing.assert_close(b.value, a.value, atol=1e-4, rtol=0)
    for a, b in zip(plain, shifted):
        torch.testing.assert_close(b, a, atol=1e-4, rtol=0)  # ...and softmax does not see it
