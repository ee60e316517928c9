"""bf16 decode (`decode_matmul`, model/layers/prefill_matmul.py): with it, products of
DECODE_BF16_MIN_ROWS rows or more (decode steps of many sequences) multiply prefill's bf16 copies, and
an int4 model's LM head a bf16 copy of its own; fewer rows keep the float32 / int4 / int8 kernels bit
for bit. The default model's int4 engine with it is its decode_matmul fp32 twin's logits within
bf16's rounding and mostly its greedy answers on a batch of 16 chat prompts (decode steps of 16 rows)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from native_backend.config.engine import EngineConfig
from native_backend.core.batch import ScheduledChunk, SchedulerOutput
from native_backend.core.interface import EngineRequest
from native_backend.core.sampling_params import SamplingParams
from native_backend.model.layers import prefill_matmul
from native_backend.model.layers.linear import C_KERNEL, ReplicatedLinear, with_bf16_prefill
from native_backend.model.layers.sharding import SINGLE
from native_backend.model.quantization import gguf_int4
from native_backend.model.quantization.method import Int4OffsetMethod, Int8HeadMethod

torch.set_num_threads(2)
pytestmark = pytest.mark.timeout(900)  # loads the default model twice
ROWS = prefill_matmul.DECODE_BF16_MIN_ROWS
BF16_REL_TOL = 2e-2  # as test_prefill_matmul.py: 8 significant bits, input, weight and output rounded once each


def rel_err(y, ref):
    return float((y - ref).abs().max() / ref.abs().max())


def gen(seed):
    return torch.Generator().manual_seed(seed)


def layer_of(method, k=576, n=1536, bias=True, seed=0):
    layer = ReplicatedLinear(k, n, bias=bias, method=method, shard=SINGLE, dtype=torch.float32,
                             device=torch.device("cpu"))
    return layer


def dense(method, seed=0):
    layer = layer_of(method)
    layer.weight.data.copy_(torch.randn(1536, 576, generator=gen(seed)) * 0.05)
    layer.bias.data.copy_(torch.randn(1536, generator=gen(seed + 1)))
    layer.process_weights_after_loading()
    return layer


def int4(min_rows, seed=0):
    method = Int4OffsetMethod(32, kernel=True, prefill_bf16=True, bf16_min_rows=min_rows)
    layer = layer_of(method, bias=False)
    q = torch.randint(0, 16, (1536, 576), generator=gen(seed), dtype=torch.uint8)
    d = (torch.rand(1536, 576 // 32, generator=gen(seed + 1)) * 0.02 + 0.001).half()
    off = (torch.randn(1536, 576 // 32, generator=gen(seed + 2)) * 0.05).half()
    for name, tensor in gguf_int4.to_int4_layout(q, d, off).items():
        getattr(layer, name).data.copy_(tensor)
    layer.process_weights_after_loading()
    return layer


def head(min_rows, seed=3):
    layer = layer_of(Int8HeadMethod(kernel=True, bf16_min_rows=min_rows), k=576, n=4096, bias=False)
    layer.weight.data.copy_(torch.randn(4096, 576, generator=gen(seed)) * 0.05)
    layer.process_weights_after_loading()
    return layer


# ------------------------------------------------------------------------------ the layers


@pytest.mark.parametrize("rows", [ROWS, 32, prefill_matmul.BF16_MIN_ROWS - 1])
def test_a_decode_batch_of_many_rows_is_the_float32_product_to_bf16_rounding(rows):
    ours, fp32 = dense(with_bf16_prefill(C_KERNEL, ROWS)), dense(C_KERNEL)
    x = torch.randn(rows, 576, generator=gen(5))
    with torch.no_grad():
        y, ref = ours(x), F.linear(x, fp32.weight, fp32.bias)
        assert not torch.equal(y, fp32(x))  # bf16 ran, not the C kernel
    assert rel_err(y, ref) < BF16_REL_TOL


@pytest.mark.parametrize("rows", [1, 2, ROWS - 1])
def test_fewer_rows_keep_the_float32_and_int4_kernels_bit_for_bit(rows):
    x = torch.randn(rows, 576, generator=gen(6))
    with torch.no_grad():
        assert torch.equal(dense(with_bf16_prefill(C_KERNEL, ROWS))(x), dense(C_KERNEL)(x))
        assert torch.equal(int4(ROWS)(x), int4(prefill_matmul.BF16_MIN_ROWS)(x))
        assert torch.equal(head(ROWS)(x), head(0)(x))


def test_an_int4_decode_batch_multiplies_the_bf16_copy():
    ours, kernel = int4(ROWS), int4(prefill_matmul.BF16_MIN_ROWS)
    x = torch.randn(32, 576, generator=gen(7))
    with torch.no_grad():
        y, ref = ours(x), kernel(x)  # the int4 C kernel: the weight as stored, float32 products
    assert not torch.equal(y, ref) and rel_err(y, ref) < BF16_REL_TOL


def test_the_int8_head_takes_a_bf16_copy_from_the_rows_on():
    ours, int8 = head(ROWS), head(0)
    assert ours.weight_bf16.shape == (4096, 576) and "weight_bf16" not in dict(int8.named_buffers())
    x = torch.randn(ROWS, 576, generator=gen(8))
    with torch.no_grad():
        y, ref = ours(x), F.linear(x, ours.weight)  # the float head as stored
        assert not torch.equal(y, int8(x))
    assert rel_err(y, ref) < BF16_REL_TOL


# ------------------------------------------------------------------------------ the setting


def test_decode_follows_prefill_and_its_setting():
    cpu, f32 = torch.device("cpu"), torch.float32
    resolve = prefill_matmul.resolve_decode
    assert resolve("auto", prefill_bf16=True, device=cpu, dtype=f32) == (
        ROWS, f"decode matmuls bf16 from {ROWS} rows (decode_matmul: auto, as prefill)")
    assert resolve("bf16", prefill_bf16=True, device=cpu, dtype=f32)[0] == ROWS
    assert resolve("fp32", prefill_bf16=True, device=cpu, dtype=f32) == (
        prefill_matmul.BF16_MIN_ROWS, "decode matmuls fp32 (decode_matmul: fp32)")
    assert resolve("auto", prefill_bf16=False, device=cpu, dtype=f32)[0] == prefill_matmul.BF16_MIN_ROWS
    assert resolve("auto", prefill_bf16=True, device=cpu, dtype=torch.bfloat16) == (prefill_matmul.BF16_MIN_ROWS, "")
    with pytest.raises(ValueError, match="decode_matmul: 'int8' is not one of"):
        resolve("int8", prefill_bf16=True, device=cpu, dtype=f32)


def test_bad_settings_are_refused_naming_the_field():
    with pytest.raises(ValueError, match="model.decode_matmul: 'fp16' is not one of"):
        EngineConfig.build(path="m.gguf", decode_matmul="fp16")
    with pytest.raises(ValueError, match="model.decode_matmul: bf16 .* needs prefill_matmul auto or bf16"):
        EngineConfig.build(path="m.gguf", decode_matmul="bf16", prefill_matmul="fp32")


# ------------------------------------------------------------------------------ the default model


def _engine(decode: str, tmp_dir: str):
    from native_backend.model.loader import default_gguf_path
    from native_backend.process.factory import make_engine_core

    return make_engine_core(EngineConfig.build(
        path=default_gguf_path(), quantization="gguf", prefill_matmul="bf16", prefill_attention="fp32",
        decode_matmul=decode, num_threads=2, max_num_seqs=16, kv_cache_bytes=64 << 20, tokenizer_cache_dir=tmp_dir))


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def engines(tokenizer_dir):
    return {d: _engine(d, tokenizer_dir) for d in ("fp32", "bf16")}


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    from native_backend.model.loader import default_gguf_path
    from native_backend.text.tokenizer import Tokenizer

    return Tokenizer.from_pretrained(default_gguf_path(), cache_dir=tokenizer_dir)


def _logits(engine, ids):
    blocks = list(range(1, len(ids) // 16 + 2))
    chunk = ScheduledChunk("t", list(ids), 0, blocks, True, SamplingParams(temperature=0.0))
    return engine.core.executor.compute_logits(SchedulerOutput([chunk]), all_tokens=True)["t"].float()


def test_the_engines_say_what_decode_runs(engines):
    assert "decode matmuls fp32 (decode_matmul: fp32)" in engines["fp32"].describe()
    line = engines["bf16"].describe()
    assert f"decode matmuls bf16 from {ROWS} rows (decode_matmul: bf16)" in line
    assert "the head's bf16 copy 54 MiB" in line and "LM head int8 rows (C kernel, bf16 from 16 rows)" in line
    fused = engines["bf16"].core.executor.model.fused_decode
    assert fused is not None and fused.max_rows == ROWS - 1  # the one-call step keeps the smaller steps


def test_decode_sized_products_are_fp32_within_bf16_rounding(engines, tokenizer):
    """A 48-token chunk of held-out text, teacher-forced (48 rows: below prefill's bf16, above decode's):
    every product and the head in bf16 against the int4 kernels' float32; 15 rows bit for bit."""
    from pydoc_data.topics import topics

    ids = tokenizer.encode("\n\n".join(topics.values()), add_special_tokens=False)[-48:]
    a, b = _logits(engines["fp32"], ids), _logits(engines["bf16"], ids)
    assert not torch.equal(a, b)
    assert float((a - b).abs().max()) < 1.5 and float((a - b).abs().mean()) < 0.15
    assert float((a.argmax(-1) == b.argmax(-1)).float().mean()) >= 0.9
    short = ids[:ROWS - 1]
    assert torch.equal(_logits(engines["fp32"], short), _logits(engines["bf16"], short))


def test_a_batch_of_16_chat_answers_mostly_agree_and_the_capital_is_right(engines, tokenizer):
    """Sixteen chat prompts at once, 24 greedy tokens: decode steps of 16 rows, bf16 against fp32."""
    questions = ["What is the capital of France?", "What is the capital of Japan?", "Name three primary colors.",
                 "How many days are in a week?", "Who wrote Romeo and Juliet?", "What do bees make?",
                 "What is the chemical symbol for gold?", "Who painted the Mona Lisa?", "What is the capital of Italy?",
                 "How many legs does a spider have?", "What is the largest ocean on Earth?", "Why is the sky blue?",
                 "What is the boiling point of water?", "Name a planet.", "What color is grass?", "What is 2 + 2?"]
    answers = {}
    for d, engine in engines.items():
        got = {i: [] for i in range(len(questions))}
        for i, q in enumerate(questions):
            prompt = tokenizer.apply_chat_template([{"role": "user", "content": q}])
            engine.add_request(EngineRequest(f"c{i}", prompt, SamplingParams(max_tokens=24, temperature=0.0)))
        while engine.has_unfinished():
            for out in engine.step():
                got[int(out.request_id[1:])].extend(out.new_token_ids)
        answers[d] = [got[i] for i in range(len(questions))]
    same = sum(a == b for a, b in zip(answers["fp32"], answers["bf16"]))
    assert same >= 8, (same, answers)
    assert "Paris" in tokenizer.decode(answers["bf16"][0])
