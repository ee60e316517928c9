"""Tiny random Llama checkpoints saved with transformers, for the model tests (fp32)."""

from __future__ import annotations

import torch
import transformers

from native_backend.model.layers.context import LayerContext
from native_backend.model.loader import load_hf_model

VOCAB = 96


def make_checkpoint(tmp_path, *, tie: bool, rope_scaling: dict | None, attention_bias: bool = False,
                    cpu_kernels: bool = True):
    """(the transformers model in eval mode, ours loaded from the safetensors it saved, on the CPU
    with kvgate's C kernels where they build, or torch alone)."""
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
        rope_theta=500.0, rope_scaling=rope_scaling, tie_word_embeddings=tie, attention_bias=attention_bias,
        initializer_range=0.15,  # large enough that logits differ by whole units between tokens
    )
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).eval()
    hf.save_pretrained(tmp_path, safe_serialization=True)
    return hf, load_hf_model(str(tmp_path), LayerContext.for_device("cpu", torch.float32, cpu_kernels=cpu_kernels))
