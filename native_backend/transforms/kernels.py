"""Which kernels a loaded model runs with on its device: the one place that decides."""

from __future__ import annotations

import torch

from native_backend import cpu_kernels
from native_backend.attention import get_attention_backend
from native_backend.models.layers import TORCH_OPS
from native_backend.models.llama import LlamaForCausalLM
from native_backend.transforms.cpu_decode import FusedDecode
from native_backend.transforms.cpu_linear import use_kernel_linears
from native_backend.transforms.cpu_ops import KERNEL_OPS


def select_kernels(model: torch.nn.Module, device: torch.device | str, use_cpu_kernels: bool = True) -> str:
    """Set the model's attention backend and, on CPU, swap in the C-kernel linear layers and
    layer ops (norms, RoPE, SwiGLU's gate).

    Returns what was chosen, for the engine's start-up log."""
    device = torch.device(device)
    model.ops, model.fused_decode = TORCH_OPS, None
    if device.type != "cpu":
        model.attn_backend = get_attention_backend(device)
        return f"attention {model.attn_backend.name}"
    if not use_cpu_kernels:
        model.attn_backend = get_attention_backend(device, "reference")
        return "torch kernels (C kernels off)"
    swapped = use_kernel_linears(model)
    model.attn_backend = get_attention_backend(device)
    if not swapped:
        return f"torch kernels (C kernels unavailable: {cpu_kernels.unavailable_reason()})"
    model.ops = KERNEL_OPS
    fused = ""
    if isinstance(model, LlamaForCausalLM):  # decode steps through the whole stack in one C call
        model.fused_decode, fused = FusedDecode(model), ", one-call decode steps"
    return f"C kernels (attention '{model.attn_backend.name}', {swapped} linear layers, fused layer ops{fused})"
