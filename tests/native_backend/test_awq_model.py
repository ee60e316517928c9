"""An int4 checkpoint end to end on a tiny random Llama: `quantize_model` writes the AutoAWQ GEMM
format, our loader builds the model with packed int4 linears, and its logits equal transformers'
Llama holding the weights that an independent unpacker reads from the file; the C kernel's
greedy tokens equal the torch reference's; damaged checkpoints fail at load naming the tensor."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from native_backend.core.batch import ScheduledChunk, SchedulerOutput
from native_backend.core.sampling_params import SamplingParams
from native_backend.execution.model_runner import ModelRunner
from native_backend.kernels import cpu_kernels
from native_backend.model.kv_cache import KVCache
from native_backend.model.layers.context import LayerContext
from native_backend.model.layers.linear import LinearBase
from native_backend.model.loader import load_hf_model
from native_backend.model.quantization.method import AWQLinearMethod
from native_backend.tools.quantize import QuantizeOptions, quantize_model
from tests.support.data.llama_checkpoints import VOCAB, make_checkpoint
from tests.support.data.awq_rules import rules_dequantize

torch.set_num_threads(2)
GROUP = 16  # the tiny model's MLP is 112 wide: 16 divides it, 32 does not
BLOCK = 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(transformers' float model, its directory, the RTN int4 directory written from it)."""
    src, out = tmp_path_factory.mktemp("float"), tmp_path_factory.mktemp("rtn")
    hf, _ = make_checkpoint(src, tie=False, rope_scaling=None)
    quantize_model(str(src), str(out), QuantizeOptions(method="rtn", group_size=GROUP))
    return hf, src, out


def runner_for(model):
    return ModelRunner(model, KVCache.for_model(model.config, num_blocks=32, block_size=BLOCK))


def chunk(tokens, start):
    table = list(range((start + len(tokens) + BLOCK - 1) // BLOCK))
    return ScheduledChunk("a", list(tokens), start, table, True, SamplingParams(temperature=0.0))


def greedy(model, prompt: list[int], n: int) -> list[int]:
    runner, tokens = runner_for(model), list(prompt)
    logits = runner.compute_logits(SchedulerOutput([chunk(tokens, 0)]))["a"]
    for _ in range(n):
        tokens.append(int(logits[-1].argmax()))
        logits = runner.compute_logits(SchedulerOutput([chunk(tokens[-1:], len(tokens) - 1)]))["a"]
    return tokens[len(prompt):]


def test_the_checkpoint_is_the_autoawq_gemm_format(checkpoint):
    _, _, out = checkpoint
    config = json.load(open(out / "config.json"))
    assert config["quantization_config"] == {"quant_method": "awq", "bits": 4, "group_size": GROUP,
                                             "zero_point": True, "version": "gemm", "modules_to_not_convert": None}
    tensors = load_file(out / "model.safetensors")
    prefix = "model.layers.1.mlp.down_proj"  # (in 112, out 64)
    assert tensors[f"{prefix}.qweight"].dtype == torch.int32 and tensors[f"{prefix}.qweight"].shape == (112, 8)
    assert tensors[f"{prefix}.qzeros"].shape == (112 // GROUP, 8)
    assert tensors[f"{prefix}.scales"].dtype == torch.float16 and tensors[f"{prefix}.scales"].shape == (7, 64)
    assert not any(name.endswith("proj.weight") for name in tensors)
    assert tensors["model.embed_tokens.weight"].dtype == torch.float16 and "lm_head.weight" in tensors


def test_loaded_packed_with_the_int4_method_and_no_float_weights(checkpoint):
    _, _, out = checkpoint
    model = load_hf_model(str(out))
    linears = [m for name, m in model.named_modules() if isinstance(m, LinearBase) and name != "lm_head"]
    assert len(linears) == 14 and all(isinstance(m.method, AWQLinearMethod) for m in linears)
    assert all(m.method.kernel == cpu_kernels.int4_available() for m in linears)
    assert all(set(m._parameters) == {"qweight", "qzeros", "scales", "bias"} for m in linears)
    assert model.fused_decode is None
    # logits from an int8 copy of the float head
    assert model.lm_head.method.name.startswith("int8 rows") and model.lm_head.weight.dtype == torch.float32
    assert model.lm_head.weight_int8.dtype == torch.int8
    assert "int4 AWQ g16" in model.ctx.kernels


@pytest.mark.parametrize("kernels", [True, False], ids=["c-kernel", "torch-reference"])
def test_logits_equal_transformers_holding_the_independently_unpacked_weights(checkpoint, kernels):
    hf, _, out = checkpoint
    tensors = load_file(out / "model.safetensors")
    state = {k: v.float() for k, v in tensors.items() if not k.endswith(("qweight", "qzeros", "scales"))}
    for k in [k for k in tensors if k.endswith(".qweight")]:
        state[k.replace(".qweight", ".weight")] = rules_dequantize(tensors, k.removesuffix(".qweight"))
    hf_int4 = type(hf)(hf.config).eval()
    hf_int4.load_state_dict(state, strict=True)
    ctx = dataclasses.replace(LayerContext.for_device("cpu", torch.float32, cpu_kernels=kernels), int8_head=False)
    ours = load_hf_model(str(out), ctx)
    prompt = torch.randint(0, VOCAB, (13,), generator=torch.Generator().manual_seed(1)).tolist()
    runner = runner_for(ours)
    logits = runner.compute_logits(SchedulerOutput([chunk(prompt[:9], 0)]), all_tokens=True)["a"]
    with torch.no_grad():
        ref = hf_int4(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(logits, ref[:9], atol=1e-4, rtol=0)
    for i in range(9, 13):  # decodes
        step = runner.compute_logits(SchedulerOutput([chunk(prompt[i:i + 1], i)]))["a"]
        torch.testing.assert_close(step[0], ref[i], atol=1e-4, rtol=0)
    with torch.no_grad():  # and int4 really moved the weights: the float model's logits differ
        assert (hf(torch.tensor([prompt])).logits[0] - ref).abs().max() > 1e-3


@pytest.mark.usefixtures("int4_kernel")
def test_greedy_tokens_of_the_c_kernel_equal_the_torch_reference(checkpoint):
    _, _, out = checkpoint
    kernel = load_hf_model(str(out), LayerContext.for_device("cpu", torch.float32))
    reference = load_hf_model(str(out), LayerContext.for_device("cpu", torch.float32, cpu_kernels=False))
    prompt = torch.randint(0, VOCAB, (7,), generator=torch.Generator().manual_seed(2)).tolist()
    assert greedy(kernel, prompt, 24) == greedy(reference, prompt, 24)


@pytest.mark.usefixtures("int4_kernel")
def test_the_int8_head_is_within_its_rounding_of_the_float_head(checkpoint):
    _, _, out = checkpoint
    model = load_hf_model(str(out))
    head = model.lm_head
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(3))
    exact = x @ head.weight.t()
    with torch.no_grad():
        y = head(x)
    # each weight moves by at most half a step (scale / 2), so each logit by sum |x| * scale / 2
    bound = x.abs().sum(1, keepdim=True) * head.weight_scale[None, :] / 2
    assert ((y - exact).abs() <= bound + 1e-5).all() and not torch.equal(y, exact)


def test_a_group_that_does_not_divide_a_layer_is_refused_naming_it(checkpoint, tmp_path):
    _, src, _ = checkpoint
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.down_proj: group size 32 does not divide its input "
                                         r"width 112; group sizes that do: none"):
        quantize_model(str(src), str(tmp_path), QuantizeOptions(method="rtn", group_size=32))


def test_an_int4_checkpoint_is_not_quantized_twice(checkpoint, tmp_path):
    _, _, out = checkpoint
    with pytest.raises(ValueError, match="already quantized"):
        quantize_model(str(out), str(tmp_path), QuantizeOptions(method="rtn", group_size=GROUP))


# ------------------------------------------------------------------------------ damaged checkpoints


def damaged_copy(out, tmp_path, edit_tensors=None, edit_config=None):
    tensors = load_file(out / "model.safetensors")
    config = json.load(open(out / "config.json"))
    if edit_tensors:
        edit_tensors(tensors)
    if edit_config:
        edit_config(config)
    save_file(tensors, tmp_path / "model.safetensors")
    json.dump(config, open(tmp_path / "config.json", "w"))
    return str(tmp_path)


def test_a_float_qweight_is_refused_naming_the_tensor(checkpoint, tmp_path):
    name = "model.layers.0.self_attn.k_proj.qweight"
    path = damaged_copy(checkpoint[2], tmp_path, lambda t: t.update({name: t[name].float()}))
    with pytest.raises(ValueError, match=f"checkpoint tensor {name}: .*torch.float32 where torch.int32"):
        load_hf_model(path)


def test_wrong_shapes_are_refused_naming_the_tensor(checkpoint, tmp_path):
    name = "model.layers.1.mlp.up_proj.scales"
    path = damaged_copy(checkpoint[2], tmp_path, lambda t: t.update({name: t[name][:, :-8].contiguous()}))
    with pytest.raises(ValueError, match=rf"checkpoint tensor {name}: .*\(4, 104\) does not fit parameter \(4, 112\)"):
        load_hf_model(path)


def test_a_missing_tensor_is_named(checkpoint, tmp_path):
    path = damaged_copy(checkpoint[2], tmp_path, lambda t: t.pop("model.layers.0.mlp.gate_proj.qzeros"))
    with pytest.raises(ValueError, match=r"missing \['model.layers.0.mlp.gate_proj.qzeros'\]"):
        load_hf_model(path)


def test_unsupported_bits_or_version_are_refused_at_load(checkpoint, tmp_path):
    path = damaged_copy(checkpoint[2], tmp_path, edit_config=lambda c: c["quantization_config"].update(bits=3))
    with pytest.raises(ValueError, match="quantization_config.bits: 3"):
        load_hf_model(path)
    path = damaged_copy(checkpoint[2], tmp_path, edit_config=lambda c: c["quantization_config"].update(version="gemv"))
    with pytest.raises(ValueError, match="quantization_config.version: 'gemv'"):
        load_hf_model(path)


def test_a_truncated_file_is_refused_naming_it(checkpoint, tmp_path):
    data = (checkpoint[2] / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])
    (tmp_path / "config.json").write_bytes((checkpoint[2] / "config.json").read_bytes())
    with pytest.raises(ValueError, match=f"{os.path.join(tmp_path, 'model.safetensors')}: "):
        load_hf_model(str(tmp_path))
