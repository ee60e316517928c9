"""How to build an engine: model, precision, cache budget and batching limits (plain data)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineConfig:
    model: str  # a GGUF file or a Hugging Face directory (config.json + safetensors)
    dtype: str = "float32"  # float32 | bfloat16 | float16: weights and activations
    kv_cache_dtype: str = "auto"  # auto (= dtype) | float32 | bfloat16 | float16
    device: str = "cpu"  # cpu | cuda | cuda:N
    block_size: int = 16  # tokens per KV-cache block
    max_num_seqs: int = 32  # requests running at once
    max_num_batched_tokens: int = 512  # token budget of one step (chunked prefill)
    max_model_len: int | None = None  # None: the model's own context length
    kv_cache_bytes: int | None = None  # KV-cache budget in bytes; None: memory_fraction decides
    memory_fraction: float = 0.9  # of device memory for weights + KV + activations (CUDA)
    cpu_kv_cache_bytes: int = 2 << 30  # default KV budget on CPU, where memory is shared
    enable_prefix_caching: bool = True
    num_threads: int | None = None  # torch threads in the engine process; None: torch's default
    tokenizer_cache_dir: str | None = None  # where a GGUF's tokenizer is unpacked once
    seed: int = 0  # for requests without a seed
    cpu_kernels: bool = True  # on CPU, kvgate's C kernels (decode attention, small-batch linears) when they build
