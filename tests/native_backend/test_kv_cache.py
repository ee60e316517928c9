"""KV-cache sizing on SmolLM2-135M's shape: 30 layers, 3 KV heads, head_dim 64."""

from __future__ import annotations

import pytest
import torch

from native_backend.model.kv_cache import KVCache, kv_bytes_per_token, plan_kv_cache, resolve_kv_dtype

SMOLLM2 = dict(num_layers=30, num_kv_heads=3, head_dim=64)
GIB = 1024**3


def test_bytes_per_token():
    # 2 (K, V) * 30 layers * 3 heads * 64 dims = 11520 elements per token
    assert kv_bytes_per_token(**SMOLLM2, bytes_per_element=2) == 23_040
    assert kv_bytes_per_token(**SMOLLM2, bytes_per_element=4) == 46_080


def test_plan_from_a_byte_budget():
    plan = plan_kv_cache(**SMOLLM2, bytes_per_element=2, block_size=16, max_model_len=8192, kv_cache_bytes=GIB)
    assert plan.bytes_per_block == 23_040 * 16 == 368_640
    assert plan.num_blocks == GIB // 368_640 == 2912
    assert plan.num_tokens == 46_592
    assert plan.blocks_per_full_sequence == 512
    assert plan.full_context_sequences == 5  # 2912 // 512
    assert plan.kv_cache_bytes <= GIB


def test_plan_from_a_memory_fraction_subtracts_weights_activations_and_reserve():
    plan = plan_kv_cache(
        **SMOLLM2, bytes_per_element=4, block_size=16, max_model_len=2048,
        memory_fraction=0.5, total_memory_bytes=8 * GIB,
        weights_bytes=540 * 1024**2, activation_bytes=256 * 1024**2, reserve_bytes=228 * 1024**2,
    )
    budget = 4 * GIB - 1024 * 1024**2  # 3 GiB left for KV
    assert plan.num_blocks == budget // (46_080 * 16) == 4369
    assert plan.full_context_sequences == 4369 // 128 == 34


def test_plan_rejects_a_budget_below_one_block():
    with pytest.raises(ValueError, match="below one block"):
        plan_kv_cache(**SMOLLM2, bytes_per_element=2, block_size=16, max_model_len=8192, kv_cache_bytes=1000)
    with pytest.raises(ValueError):
        plan_kv_cache(**SMOLLM2, bytes_per_element=2, block_size=16, max_model_len=8192, memory_fraction=0.9)


def test_cache_layout_and_dtypes():
    cache = KVCache(num_blocks=5, block_size=16, **SMOLLM2, dtype="bf16")
    layer = cache.layer(29)
    assert layer.key.shape == layer.value.shape == (5, 16, 3, 64) and layer.key.dtype == torch.bfloat16
    assert (layer.num_blocks, layer.block_size, layer.num_kv_heads, layer.head_dim) == (5, 16, 3, 64)
    assert cache.nbytes == 5 * 16 * kv_bytes_per_token(**SMOLLM2, bytes_per_element=2)
    assert resolve_kv_dtype(torch.float16).bytes_per_element == 2
    assert resolve_kv_dtype("fp8").storage == torch.float8_e4m3fn and resolve_kv_dtype("int8").bytes_per_element == 1
    with pytest.raises(ValueError, match="unknown KV cache dtype 'fp4'"):
        resolve_kv_dtype("fp4")
