"""The formats the engine stores weights and the KV cache in: one list of each, torch-free.

    kv_cache_dtype   auto (the model's dtype) | a KV_FORMATS name (or an alias: fp8, fp16, ...)
    dtype            DTYPES: the weights and activations of a float model
    quantization     WEIGHT_QUANTIZATIONS: how the engine runs a checkpoint's weights

Read by the engine's settings (config/engine.py), the KV cache (model/kv_cache.py, which adds each
KV format's torch storage), the capacity planner (tools/memory_plan.py, with the weight formats it
sizes: WEIGHT_FORMATS), the native plugin's settings and, by a test, the Helm chart's schema.
"""

from __future__ import annotations

from dataclasses import dataclass

DTYPES = ("float32", "bfloat16", "float16")
WEIGHT_QUANTIZATIONS = ("none", "awq", "gguf")  # float (or AWQ detected) | AWQ int4 required | GGUF Q4 kept int4
# Prefill chunks' matrix products: auto (bf16 for int4 linears where the CPU has AMX / AVX512_BF16
# and it measures faster) | fp32 | bf16 (model/layers/prefill_matmul.py).
PREFILL_MATMULS = ("auto", "fp32", "bf16")
# Decode steps' matrix products (linears and the int8 LM head) from DECODE_BF16_MIN_ROWS rows: auto (bf16
# where the prefill matmuls resolved to bf16: their copies are already resident) | fp32 | bf16.
DECODE_MATMULS = ("auto", "fp32", "bf16")
# Prefill chunks' attention (Q K^T and P V): auto (bf16 where the prefill matmuls run in bf16, the CPU has
# AVX512_BF16 and it measures faster) | fp32 | bf16 (model/layers/prefill_attention.py).
PREFILL_ATTENTIONS = ("auto", "fp32", "bf16")
# An int4 model's LM head on the CPU: auto (int8 where it measurably helps) | int8 (a copy, a scale per
# vocabulary row) | float (the head as stored).
LM_HEADS = ("auto", "int8", "float")
KV_SCALES = ("auto", "calibrate", "unit")  # fp8's per-layer K/V scales: checkpoint else calibration | always calibrate | 1.0


@dataclass(frozen=True)
class KVFormat:
    """How K/V elements are stored.

    scaling "none":            stored = x (a float dtype)
    scaling "per_layer" (fp8): stored = fp8(clamp(x / scale, -max, max)), read = fp8 * scale, one K
                               and one V scale per layer (two floats a layer: not counted per token)
    scaling "per_token_head" (int8): scale = max|x| / 127 over head_dim, stored = round(x / scale),
                               one float32 scale per token per KV head beside the block
    """

    name: str
    bytes_per_element: int
    scaling: str = "none"
    max_value: float = 0.0  # the largest finite stored magnitude (fp8 e4m3 448, e5m2 57344; int8 127)
    code: int = 0  # the C and Triton kernels' name for the format (kernels/csrc/kv_quant.c)

    @property
    def quantized(self) -> bool:
        return self.scaling != "none"

    @property
    def scale_bytes_per_head(self) -> int:
        """Bytes of scale stored per token per KV head (K or V): int8's float32 scale."""
        return 4 if self.scaling == "per_token_head" else 0


KV_FORMATS: dict[str, KVFormat] = {
    "float32": KVFormat("float32", 4),
    "bfloat16": KVFormat("bfloat16", 2),
    "float16": KVFormat("float16", 2),
    "fp8_e4m3": KVFormat("fp8_e4m3", 1, "per_layer", 448.0, code=1),
    "fp8_e5m2": KVFormat("fp8_e5m2", 1, "per_layer", 57344.0, code=2),
    "int8": KVFormat("int8", 1, "per_token_head", 127.0, code=3),
}
KV_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp8": "fp8_e4m3",
              "float8_e4m3fn": "fp8_e4m3", "float8_e5m2": "fp8_e5m2"}
KV_CACHE_DTYPES = ("auto", *KV_FORMATS)  # the kv_cache_dtype setting's values


def kv_format(name: str) -> KVFormat:
    """The KV format named `name` (or one of its aliases)."""
    found = KV_FORMATS.get(KV_ALIASES.get(name, name))
    if found is None:
        raise ValueError(f"unknown KV cache dtype {name!r}; expected one of {sorted(KV_FORMATS)}")
    return found


@dataclass(frozen=True)
class WeightFormat:
    """How a checkpoint stores its weights, for sizing (`kvgate plan`). Embeddings, norms, biases and
    the LM head stay in `other_bytes` (AWQ and FP8 checkpoints quantize only the decoder's linears)."""

    name: str
    linear_bits: int  # bits per weight of q/k/v/o and the MLP
    other_bytes: int
    group_size: int | None = None  # one scale and one zero point per `group_size` input weights
    group_bits: int = 0  # bits of that scale + zero point
    activation_bytes: int = 2  # the dtype the model computes (and an "auto" KV cache stores) in
    auto_kv_dtype: str = "float16"


WEIGHT_FORMATS: dict[str, WeightFormat] = {
    "fp32": WeightFormat("fp32", 32, 4, activation_bytes=4, auto_kv_dtype="float32"),
    "fp16": WeightFormat("fp16", 16, 2),
    "bf16": WeightFormat("bf16", 16, 2, auto_kv_dtype="bfloat16"),
    # AutoAWQ GEMM: int4 weights, an fp16 scale and a packed 4-bit zero per group of 128.
    "awq-int4": WeightFormat("awq-int4", 4, 2, group_size=128, group_bits=16 + 4),
    # Per-tensor scales (a few bytes a layer) are left out.
    "fp8": WeightFormat("fp8", 8, 2, auto_kv_dtype="bfloat16"),
}
