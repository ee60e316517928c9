"""Model transforms: the C-kernel linear layers and the choice of kernels for a device."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from native_backend import cpu_kernels
from native_backend.transforms import cpu_linear
from native_backend.transforms.cpu_linear import KernelLinear, use_kernel_linears
from native_backend.transforms.kernels import select_kernels

torch.set_num_threads(2)
pytestmark = pytest.mark.skipif(not cpu_kernels.PLATFORM_SUPPORTED, reason="C kernels are for x86-64 with AVX2/FMA")


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.proj = nn.Linear(16, 24, bias=True)
        self.odd = nn.Linear(12, 5)  # in_features not a multiple of 8: always F.linear
        self.head = nn.Linear(16, 50, bias=False)
        self.head.weight = self.embed.weight  # tied


def test_swap_keeps_parameters_ties_and_state_dict():
    model = Tiny()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = {id(p) for p in model.parameters()}
    assert use_kernel_linears(model) == 3
    assert all(type(m) is KernelLinear for m in (model.proj, model.odd, model.head))
    assert model.head.weight is model.embed.weight
    assert {id(p) for p in model.parameters()} == params
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_kernel_linear_matches_f_linear_and_falls_back_where_it_must(monkeypatch):
    model = Tiny()
    use_kernel_linears(model)
    calls = []
    real = cpu_kernels.linear_unchecked
    monkeypatch.setattr(cpu_kernels, "linear_unchecked", lambda *a: calls.append(a[0].shape) or real(*a))
    with torch.inference_mode():
        x = torch.randn(7, 16)
        torch.testing.assert_close(model.proj(x), F.linear(x, model.proj.weight, model.proj.bias))
        assert calls == [(7, 16)]
        many = torch.randn(cpu_linear.KERNEL_MAX_ROWS + 1, 16)  # prefill-sized: MKL
        torch.testing.assert_close(model.proj(many), F.linear(many, model.proj.weight, model.proj.bias))
        model.odd(torch.randn(3, 12))
        model.proj(torch.randn(2, 3, 16))  # not 2-D
        model.proj(torch.randn(3, 16, dtype=torch.float64).float().to(torch.bfloat16).float())  # fp32 again: kernel
    assert calls == [(7, 16), (3, 16)]
    y = model.proj(torch.randn(3, 16, requires_grad=True))  # autograd wants F.linear
    assert y.requires_grad and calls == [(7, 16), (3, 16)]


def test_select_kernels_on_cpu_with_and_without_c_kernels():
    on, off = Tiny(), Tiny()
    assert select_kernels(on, "cpu").startswith("C kernels")
    assert on.attn_backend.name == "cpu" and type(on.proj) is KernelLinear
    assert "off" in select_kernels(off, "cpu", use_cpu_kernels=False)
    assert off.attn_backend.name == "reference" and type(off.proj) is nn.Linear
