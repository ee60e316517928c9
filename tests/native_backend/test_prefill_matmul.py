"""bf16 prefill (`prefill_matmul`, model/layers/prefill_matmul.py): chunks of BF16_MIN_ROWS rows or
more multiply a bf16 copy of each linear's weight, everything shorter keeps its float32 path bit
for bit; `auto` picks bf16 only for int4 linears on a CPU with bf16 matrix instructions; and the
default model's int4 engine with bf16 prefill (matmuls, and attention where the CPU has its bf16
kernel: test_prefill_attention_bf16.py) is its fp32-prefill twin's logits within bf16's rounding
and mostly its greedy answers on the chat battery."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from native_backend.config.engine import EngineConfig
from native_backend.core.batch import ScheduledChunk, SchedulerOutput
from native_backend.core.interface import EngineRequest
from native_backend.core.sampling_params import SamplingParams
from native_backend.model.layers import prefill_matmul
from native_backend.model.layers.context import LayerContext
from native_backend.model.layers.linear import C_KERNEL, DENSE, ReplicatedLinear, with_bf16_prefill
from native_backend.model.layers.sharding import SINGLE
from native_backend.model.quantization import gguf_int4
from native_backend.model.quantization.method import Int4OffsetMethod
from native_backend.model.quantization.reference import int4_linear_offset
from tests.support.checks import cpu_flags

torch.set_num_threads(2)
pytestmark = pytest.mark.timeout(900)  # loads the default model twice
ROWS = prefill_matmul.BF16_MIN_ROWS
# bf16 keeps 8 significant bits: the input and weight each rounded (2^-9 relative), the output once
# more; summed over 576 products the error of a row is a few parts in a thousand of its largest value.
BF16_REL_TOL = 2e-2


def rel_err(y, ref):
    return float((y - ref).abs().max() / ref.abs().max())


def gen(seed):
    return torch.Generator().manual_seed(seed)


def dense_layer(method, k=576, n=1536, seed=0):
    layer = ReplicatedLinear(k, n, bias=True, method=method, shard=SINGLE, dtype=torch.float32,
                             device=torch.device("cpu"))
    layer.weight.data.copy_(torch.randn(n, k, generator=gen(seed)) * 0.05)
    layer.bias.data.copy_(torch.randn(n, generator=gen(seed + 1)))
    layer.process_weights_after_loading()
    return layer


def int4_layer(prefill_bf16, k=576, n=1536, seed=0):
    method = Int4OffsetMethod(32, kernel=False, prefill_bf16=prefill_bf16)
    layer = ReplicatedLinear(k, n, bias=False, method=method, shard=SINGLE, dtype=torch.float32,
                             device=torch.device("cpu"))
    q = torch.randint(0, 16, (n, k), generator=gen(seed), dtype=torch.uint8)
    d = (torch.rand(n, k // 32, generator=gen(seed + 1)) * 0.02 + 0.001).half()
    off = (torch.randn(n, k // 32, generator=gen(seed + 2)) * 0.05).half()
    for name, tensor in gguf_int4.to_int4_layout(q, d, off).items():
        getattr(layer, name).data.copy_(tensor)
    layer.process_weights_after_loading()
    return layer


# ------------------------------------------------------------------------------ the layers


@pytest.mark.parametrize("float_method", [DENSE, C_KERNEL], ids=["dense", "C kernel"])
def test_a_prefill_chunk_is_the_float32_product_to_bf16_rounding(float_method):
    fp32, bf16 = dense_layer(float_method), dense_layer(with_bf16_prefill(float_method))
    x = torch.randn(ROWS + 37, 576, generator=gen(5))
    with torch.no_grad():
        ours, ref = bf16(x), F.linear(x, fp32.weight, fp32.bias)
    assert ours.dtype == torch.float32 and not torch.equal(ours, ref)  # bf16 did run
    assert rel_err(ours, ref) < BF16_REL_TOL
    assert bf16.weight_bf16.dtype == torch.bfloat16 and bf16.weight_bf16.shape == (1536, 576)


@pytest.mark.parametrize("rows", [1, 4, ROWS - 1])
def test_decode_and_short_chunks_keep_the_float32_path_bit_for_bit(rows):
    fp32, bf16 = dense_layer(C_KERNEL), dense_layer(with_bf16_prefill(C_KERNEL))
    x = torch.randn(rows, 576, generator=gen(6))
    with torch.no_grad():
        assert torch.equal(bf16(x), fp32(x))
    int4, int4_bf16 = int4_layer(False), int4_layer(True)
    with torch.no_grad():
        assert torch.equal(int4_bf16(x), int4(x))


def test_an_int4_layer_prefills_from_a_bf16_copy_of_its_dequantized_weight():
    layer = int4_layer(True)
    p = layer._parameters
    x = torch.randn(2 * ROWS, 576, generator=gen(7))
    with torch.no_grad():
        ours, ref = layer(x), int4_linear_offset(x, p["qweight"], p["offsets"], p["scales"])
    assert not torch.equal(ours, ref) and rel_err(ours, ref) < BF16_REL_TOL
    assert layer.weight_bf16.shape == (1536, 576)  # (out, in): the packed weight is (in, out / 8)


def test_without_the_setting_no_copy_is_kept():
    assert "weight_bf16" not in dict(dense_layer(C_KERNEL).named_buffers())
    assert "weight_bf16" not in dict(int4_layer(False).named_buffers())


# ------------------------------------------------------------------------------ the setting


def test_explicit_settings_and_other_devices():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert prefill_matmul.resolve("fp32", device=cpu, dtype=torch.float32, int4=True)[0] is False
    on, note = prefill_matmul.resolve("bf16", device=cpu, dtype=torch.float32, int4=False)
    assert on and note == f"prefill matmuls bf16 from {ROWS} rows (prefill_matmul: bf16)"
    # a bf16 model, or a GPU, runs its own dtype everywhere: nothing to choose
    assert prefill_matmul.resolve("bf16", device=cpu, dtype=torch.bfloat16, int4=True) == (False, "")
    assert prefill_matmul.resolve("auto", device=cuda, dtype=torch.float32, int4=True) == (False, "")
    with pytest.raises(ValueError, match="prefill_matmul: 'fp16'"):
        prefill_matmul.resolve("fp16", device=cpu, dtype=torch.float32, int4=True)


def test_auto_keeps_a_float32_model_in_float32():
    on, note = prefill_matmul.resolve("auto", device=torch.device("cpu"), dtype=torch.float32, int4=False)
    assert not on and note.startswith("prefill matmuls fp32 (auto:")


def test_auto_for_int4_follows_the_cpu_and_the_probe(monkeypatch):
    """What auto decides for int4 from what the CPU has and what the probe measured (both faked
    here, so every branch runs on any machine; the real probe runs in the engine tests below)."""
    args = dict(device=torch.device("cpu"), dtype=torch.float32, int4=True)
    monkeypatch.setattr(prefill_matmul, "bf16_unit", lambda: None)
    assert prefill_matmul.resolve("auto", **args) == (False, "prefill matmuls fp32 (auto: no AMX or AVX512_BF16)")
    monkeypatch.setattr(prefill_matmul, "bf16_unit", lambda: "AMX")
    monkeypatch.setattr(prefill_matmul, "probe_speedup", lambda: 1.2)
    on, note = prefill_matmul.resolve("auto", **args)
    assert not on and "bf16 1.2x fp32" in note
    monkeypatch.setattr(prefill_matmul, "probe_speedup", lambda: 6.0)
    on, note = prefill_matmul.resolve("auto", **args)
    assert on and note.startswith(f"prefill matmuls bf16 from {ROWS} rows (auto: AMX, bf16 6.0x fp32")


def test_a_followed_probe_decides_without_measuring(monkeypatch):
    """A tensor-parallel worker decides from rank 0's probe (follow): its own never runs."""
    args = dict(device=torch.device("cpu"), dtype=torch.float32, int4=True)
    monkeypatch.setattr(prefill_matmul, "probe_speedup", lambda: pytest.fail("the worker probed on its own"))
    monkeypatch.setattr(prefill_matmul, "_followed", None)
    prefill_matmul.follow(("AVX512_BF16", 3.0))
    assert prefill_matmul.auto_probe() == ("AVX512_BF16", 3.0)
    on, note = prefill_matmul.resolve("auto", **args)
    assert on and "(auto: AVX512_BF16, bf16 3.0x fp32" in note
    prefill_matmul.follow((None, None))
    assert prefill_matmul.resolve("auto", **args) == (False, "prefill matmuls fp32 (auto: no AMX or AVX512_BF16)")


def test_the_probe_alternates_its_two_products_and_keeps_each_ones_fastest(monkeypatch):
    calls, clock = [], iter([0.0, 5.0, 5.0, 6.0, 6.0, 9.0, 9.0, 9.5, 9.5, 12.0, 12.0, 13.0])
    monkeypatch.setattr(prefill_matmul, "time", types.SimpleNamespace(perf_counter=lambda: next(clock)))
    first, second = prefill_matmul.best_of_alternating(lambda: calls.append("a"), lambda: calls.append("b"), 3)
    assert calls == ["a", "b"] * 4  # a warm-up each, then three rounds of one call each
    assert (first, second) == (2.5, 0.5)  # a: 5, 3, 2.5 s; b: 1, 0.5, 1 s


def test_the_probe_times_real_products():
    assert prefill_matmul.probe_speedup() > 0
    assert prefill_matmul.bf16_unit() in (None, "AVX512_BF16", "AMX")


@pytest.mark.parametrize("field, value", [("prefill_matmul", "fp16"), ("lm_head", "int4")])
def test_bad_values_are_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"model.{field}: '{value}' is not one of"):
        EngineConfig.build(path="m.gguf", **{field: value})


def test_a_context_with_bf16_prefill_keeps_the_head_on_float32():
    ctx = LayerContext.for_device("cpu", torch.float32).with_prefill_matmul("bf16")
    assert ctx.linear_method.prefill_bf16 and not getattr(ctx.head_method, "prefill_bf16", False)


# ------------------------------------------------------------------------------ the default model


def _engine(prefill: str, tmp_dir: str):
    from native_backend.model.loader import default_gguf_path
    from native_backend.process.factory import make_engine_core

    return make_engine_core(EngineConfig.build(
        path=default_gguf_path(), quantization="gguf", prefill_matmul=prefill, prefill_attention=prefill,
        decode_matmul="fp32", num_threads=2, max_num_seqs=16, kv_cache_bytes=64 << 20, tokenizer_cache_dir=tmp_dir))


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def engines(tokenizer_dir):
    return {p: _engine(p, tokenizer_dir) for p in ("fp32", "bf16")}


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    from native_backend.model.loader import default_gguf_path
    from native_backend.text.tokenizer import Tokenizer

    return Tokenizer.from_pretrained(default_gguf_path(), cache_dir=tokenizer_dir)


def _logits(engine, ids):
    blocks = list(range(1, len(ids) // 16 + 2))
    chunk = ScheduledChunk("t", list(ids), 0, blocks, True, SamplingParams(temperature=0.0))
    return engine.core.executor.compute_logits(SchedulerOutput([chunk]), all_tokens=True)["t"].float()


def _text_ids(tokenizer, n):
    from pydoc_data.topics import topics

    return tokenizer.encode("\n\n".join(topics.values()), add_special_tokens=False)[-n:]


def test_the_engines_say_what_prefill_runs(engines):
    assert "prefill matmuls fp32 (prefill_matmul: fp32)" in engines["fp32"].describe()
    line = engines["bf16"].describe()
    assert "prefill matmuls bf16 from 64 rows (prefill_matmul: bf16)" in line
    # expected from the test's own read of /proc/cpuinfo, not the engine's detection
    assert ("prefill attention bf16 (prefill_attention: bf16)" if cpu_flags.has(cpu_flags.BF16_ATTENTION) else
            "prefill attention fp32 (prefill_attention: bf16, but ") in line
    assert "bf16 prefill copies of the linears 202 MiB" in line


def test_int4_prefill_logits_are_fp32_prefill_logits_within_bf16_rounding(engines, tokenizer):
    """Teacher-forced over 256 tokens of held-out text in one chunk. Measured over 2,048 positions
    (bench/prefill_matmul.py --only agreement): max |diff| 0.54, 99.9th percentile 0.26, mean
    0.049 (the logits span about 40), argmax the same at 99.4 % of positions."""
    ids = _text_ids(tokenizer, 256)
    a, b = _logits(engines["fp32"], ids), _logits(engines["bf16"], ids)
    assert not torch.equal(a, b)
    assert float((a - b).abs().max()) < 1.5
    assert float((a - b).abs().mean()) < 0.15
    assert float((a.argmax(-1) == b.argmax(-1)).float().mean()) >= 0.97
    short = ids[:ROWS - 1]  # a chunk below BF16_MIN_ROWS: the float32 path, bit for bit
    assert torch.equal(_logits(engines["fp32"], short), _logits(engines["bf16"], short))


def test_chat_answers_mostly_agree_and_the_capital_is_right(engines, tokenizer):
    """Twelve prompts of bench/kv_quant.py's chat battery through the template, all at once (one
    prefill chunk of ~400 rows), 24 greedy tokens. Measured on all 36 with 48 tokens: 31
    identical, 35 with the same first token, 96 % of each answer before any divergence."""
    questions = ["What is the capital of France?", "What is the capital of Japan?", "Name three primary colors.",
                 "How many days are in a week?", "Who wrote Romeo and Juliet?", "What do bees make?",
                 "What is the chemical symbol for gold?", "Who painted the Mona Lisa?", "What is the capital of Italy?",
                 "How many legs does a spider have?", "What is the largest ocean on Earth?", "Why is the sky blue?"]
    answers = {}
    for p, engine in engines.items():
        prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in questions]
        got = {i: [] for i in range(len(prompts))}
        for i, prompt in enumerate(prompts):
            engine.add_request(EngineRequest(f"c{i}", prompt, SamplingParams(max_tokens=24, temperature=0.0)))
        while engine.has_unfinished():
            for out in engine.step():
                got[int(out.request_id[1:])].extend(out.new_token_ids)
        answers[p] = [got[i] for i in range(len(prompts))]
    same = sum(a == b for a, b in zip(answers["fp32"], answers["bf16"]))
    assert same >= 9, (same, answers)
    assert "Paris" in tokenizer.decode(answers["bf16"][0])
