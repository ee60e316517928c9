"""A tensor-parallel rank reads only its slices of the checkpoint: the loader hands it unread
tensors (GGUF, safetensors) that weight loaders narrow before reading, and every slice read that
way equals the same slice cut from the whole tensor, bit for bit, for every rank of TP 3 along
both dimensions (rows: column-parallel; columns: row-parallel), across the file's formats (Q4_1
and Q8_0 blocks, f32), q/k rows un-permuted per head after the cut; an AWQ checkpoint's packed
tensors split so that its ranks hold, between them, exactly the checkpoint's int4 weights."""

from __future__ import annotations

import gguf
import pytest
import torch

from native_backend.config.model import ModelConfig
from native_backend.model.layers.sharding import ShardSpec
from native_backend.model.loader import SafetensorsSlice, default_gguf_path, gguf_tensors, safetensors_tensors
from tests.support.checks.tensor_parallel_checks import tiny_gqa_llama

NAMES = ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
         "model.layers.0.self_attn.o_proj.weight", "model.layers.5.mlp.down_proj.weight",
         "model.layers.5.mlp.up_proj.weight", "model.layers.5.input_layernorm.weight"]


def assert_every_slice_equal(whole: torch.Tensor, lazy, size: int) -> None:
    assert tuple(whole.shape) == lazy.shape
    for rank in range(size):
        shard = ShardSpec(rank, size)
        for dim in range(whole.dim()):
            assert torch.equal(shard.narrow(lazy, dim).read(), shard.narrow(whole, dim)), (rank, dim)


def test_gguf_slices_equal_the_whole_tensor_cut():
    reader = gguf.GGUFReader(default_gguf_path())
    config = ModelConfig.from_gguf(reader)
    formats = {t.name: t.tensor_type.name for t in reader.tensors}
    whole = {n: t for n, t in gguf_tensors(reader, config) if n in NAMES}
    lazy = {n: t for n, t in gguf_tensors(reader, config, lazy=True) if n in NAMES}
    for name in NAMES:
        assert_every_slice_equal(whole[name], lazy[name], 3)
    assert {"Q4_1", "Q8_0", "F32"} <= set(formats.values())  # the formats the slices went through


def test_safetensors_slices_equal_the_whole_tensor_cut(tmp_path):
    import glob

    files = sorted(glob.glob(f"{tiny_gqa_llama(tmp_path)}/*.safetensors"))
    whole = dict(safetensors_tensors(files))
    lazy = dict(safetensors_tensors(files, lazy=True))
    assert set(whole) == set(lazy) and all(isinstance(t, SafetensorsSlice) for t in lazy.values())
    for name in whole:
        assert_every_slice_equal(whole[name], lazy[name], 2)


@pytest.mark.parametrize("size", [2, 4])
def test_a_rank_built_from_slices_holds_the_same_parameters(tmp_path, size):
    """Rank by rank, the model loaded from lazy slices equals one loaded from whole tensors."""
    import glob

    from native_backend.model.layers.context import LayerContext
    from native_backend.model.loader import build_model

    path = tiny_gqa_llama(tmp_path)
    config = ModelConfig.from_hf_dir(path)
    files = sorted(glob.glob(f"{path}/*.safetensors"))
    for rank in range(size):
        ctx = LayerContext.for_device("cpu", torch.float32, shard=ShardSpec(rank, size))
        a = build_model(config, safetensors_tensors(files), ctx).state_dict()
        b = build_model(config, safetensors_tensors(files, lazy=True), ctx).state_dict()
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_awq_ranks_hold_the_checkpoints_int4_weights_between_them(tmp_path):
    """TP 2 of an AWQ g8 checkpoint, each rank loaded from lazy slices of the packed tensors: the
    weights an unpacker written from the format's rules reads from the ranks' qweight, qzeros and
    scales, side by side (column-parallel: outputs; row-parallel: inputs), are the checkpoint's."""
    from safetensors.torch import load_file

    from tests.support.data.awq_rules import rules_dequantize
    from native_backend.model.layers.context import LayerContext
    from native_backend.model.loader import load_hf_model
    from native_backend.tools.quantize import QuantizeOptions, quantize_model

    awq = str(tmp_path / "int4-g8")
    quantize_model(tiny_gqa_llama(tmp_path / "float"), awq, QuantizeOptions(method="rtn", group_size=8))
    whole = load_file(f"{awq}/model.safetensors")
    ranks = [load_hf_model(awq, LayerContext.for_device("cpu", torch.float32, shard=ShardSpec(r, 2))).state_dict()
             for r in range(2)]
    linears = [name.removesuffix(".qweight") for name in whole if name.endswith(".qweight")]
    assert len(linears) == 2 * 7
    for prefix in linears:
        dim = 1 if prefix.endswith(("o_proj", "down_proj")) else 0  # (out, in): row-parallel split inputs
        parts = [rules_dequantize(r, prefix) for r in ranks]
        assert all(p.shape[dim] * 2 == rules_dequantize(whole, prefix).shape[dim] for p in parts)
        assert torch.equal(torch.cat(parts, dim), rules_dequantize(whole, prefix)), prefix
