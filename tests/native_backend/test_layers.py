"""Layers built in their final form: linear methods, shard specs and their weight loaders, the
layer context's choice of kernels, and a model loaded tensor by tensor."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from native_backend.kernels import cpu_kernels
from native_backend.model.layers import linear
from native_backend.model.layers.context import LayerContext
from native_backend.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from native_backend.model.layers.linear import C_KERNEL, DENSE, ColumnParallelLinear, RowParallelLinear
from native_backend.model.layers.sharding import ShardSpec
from native_backend.model.loader import build_model, safetensors_tensors
from tests.support.data.llama_checkpoints import make_checkpoint

torch.set_num_threads(2)
needs_kernels = pytest.mark.usefixtures("c_kernels")  # skips only where the CPU cannot run them (tests/support/checks/c_kernels.py)


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def make(cls, in_f, out_f, *, bias=True, method=DENSE, shard=ShardSpec()):
    return cls(in_f, out_f, bias=bias, method=method, shard=shard, dtype=torch.float32, device=torch.device("cpu"))


def load(layer, weight, bias=None):
    layer.weight.weight_loader(layer.weight, weight)
    if bias is not None:
        layer.bias.weight_loader(layer.bias, bias)


def test_column_parallel_ranks_hold_their_rows_and_concatenate_to_the_whole():
    w, b, x = randn(12, 8, seed=1), randn(12, seed=2), randn(5, 8, seed=3)
    parts = []
    for rank in range(3):
        layer = make(ColumnParallelLinear, 8, 12, shard=ShardSpec(rank, 3))
        load(layer, w, b)
        assert layer.weight.shape == (4, 8) and torch.equal(layer.weight, w[4 * rank: 4 * rank + 4])
        parts.append(layer(x))
    torch.testing.assert_close(torch.cat(parts, dim=1), F.linear(x, w, b))


def test_row_parallel_partial_sums_add_up_to_the_whole_with_the_bias_once(monkeypatch):
    w, b, x = randn(6, 16, seed=4), randn(6, seed=5), randn(3, 16, seed=6)
    partials = []
    for rank in range(2):
        layer = make(RowParallelLinear, 16, 6, shard=ShardSpec(rank, 2))
        load(layer, w, b)
        assert layer.weight.shape == (6, 8) and layer.bias.shape == (6,)
        # One process plays both ranks: the all-reduce keeps each partial for the sum below.
        monkeypatch.setattr(ShardSpec, "all_reduce", lambda self, t: partials.append(t.clone()) or t)
        layer(x[:, 8 * rank: 8 * rank + 8])
    torch.testing.assert_close(partials[0] + partials[1] + b, F.linear(x, w, b), atol=1e-5, rtol=0)


def test_sizes_that_do_not_split_are_refused_with_the_numbers():
    with pytest.raises(ValueError, match="output features: 10 cannot be split across 3 ranks"):
        make(ColumnParallelLinear, 8, 10, shard=ShardSpec(0, 3))
    with pytest.raises(ValueError, match="rank must be in"):
        ShardSpec(2, 2)


def test_a_checkpoint_tensor_of_the_wrong_shape_is_refused():
    layer = make(ColumnParallelLinear, 8, 12)
    with pytest.raises(ValueError, match=r"\(12, 9\) does not fit parameter \(12, 8\)"):
        load(layer, randn(12, 9))


def test_vocab_parallel_embedding_masks_ids_of_other_ranks(monkeypatch):
    table, ids = randn(10, 4, seed=7), torch.tensor([0, 9, 4, 5, 3])
    outs = []
    monkeypatch.setattr(ShardSpec, "all_reduce", lambda self, t: outs.append(t) or t)
    for rank in range(2):
        emb = VocabParallelEmbedding(10, 4, shard=ShardSpec(rank, 2), dtype=torch.float32, device=torch.device("cpu"))
        emb.weight.weight_loader(emb.weight, table)
        emb(ids)
    torch.testing.assert_close(outs[0] + outs[1], table[ids])


def test_a_tied_head_shares_the_embedding_parameter():
    cpu = torch.device("cpu")
    emb = VocabParallelEmbedding(10, 8, shard=ShardSpec(), dtype=torch.float32, device=cpu)
    head = ParallelLMHead(10, 8, method=DENSE, shard=ShardSpec(), dtype=torch.float32, device=cpu, tie_to=emb)
    assert head.weight is emb.weight


@needs_kernels
def test_c_kernel_method_matches_f_linear_and_falls_back_where_it_must(monkeypatch):
    layer = make(ColumnParallelLinear, 16, 24, method=C_KERNEL)
    odd = make(ColumnParallelLinear, 12, 5, method=C_KERNEL)  # in_features not a multiple of 8
    load(layer, randn(24, 16, seed=8), randn(24, seed=9))
    load(odd, randn(5, 12, seed=10), randn(5, seed=11))
    calls = []
    real = cpu_kernels.linear_unchecked
    monkeypatch.setattr(cpu_kernels, "linear_unchecked", lambda *a: calls.append(a[0].shape) or real(*a))
    with torch.inference_mode():
        x = randn(7, 16, seed=12)
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
        many = randn(linear.KERNEL_MAX_ROWS + 1, 16, seed=13)  # prefill-sized: MKL
        torch.testing.assert_close(layer(many), F.linear(many, layer.weight, layer.bias))
        odd(randn(3, 12))
        layer(randn(2, 3, 16))  # not 2-D
    assert calls == [(7, 16)]
    y = layer(randn(3, 16).requires_grad_())  # autograd wants F.linear
    assert y.requires_grad and calls == [(7, 16)]


@needs_kernels
def test_layer_context_decides_kernels_once_per_device():
    on = LayerContext.for_device("cpu", torch.float32)
    assert on.linear_method is C_KERNEL and on.attention.name == "cpu" and on.fuse_decode
    assert on.kernels.startswith("C kernels")
    off = LayerContext.for_device("cpu", torch.float32, cpu_kernels=False)
    assert off.linear_method is DENSE and off.attention.name == "reference" and not off.fuse_decode
    half = LayerContext.for_device("cpu", torch.bfloat16)
    assert not half.fuse_decode  # the one-call step reads float32 weights only


def test_model_loads_tensor_by_tensor_and_refuses_a_mismatched_checkpoint(tmp_path):
    _, ours = make_checkpoint(tmp_path, tie=False, rope_scaling=None, cpu_kernels=False)
    files = sorted(str(p) for p in tmp_path.glob("*.safetensors"))
    seen = []

    def counted():
        for name, tensor in safetensors_tensors(files):
            seen.append(name)
            yield name, tensor

    again = build_model(ours.config, counted(), ours.ctx)
    assert len(seen) == len(dict(ours.named_parameters()))
    assert all(torch.equal(a, b) for a, b in zip(again.parameters(), ours.parameters()))
    with pytest.raises(ValueError, match=r"missing \['lm_head.weight'\], unexpected \['extra'\]"):
        build_model(ours.config, ((n, t) for n, t in [*safetensors_tensors(files), ("extra", torch.zeros(1))]
                                  if n != "lm_head.weight"), ours.ctx)
