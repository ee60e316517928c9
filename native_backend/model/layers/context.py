"""What a model is built with: the one place that decides precision, kernels and sharding.

    LayerContext.for_device("cpu", torch.float32)   C-kernel linears, fused ops, 'cpu' attention,
                                                     one-call decode steps (where the kernels build)
    LayerContext.for_device("cpu", ..., cpu_kernels=False)   torch alone
    LayerContext.for_device("cuda", torch.bfloat16)          dense linears, Triton attention
    ctx.with_quantization(QuantConfig(group_size=64))        int4 AWQ linears (an AWQ checkpoint)
    dataclasses.replace(ctx, gguf_q4=True)                   a GGUF's Q4_0 / Q4_1 linears kept int4
    ctx.with_prefill_matmul("auto")                          prefill chunks in bf16 where it pays
                                                             (layers/prefill_matmul.py), their attention
                                                             as ctx.prefill_attention says
                                                             (layers/prefill_attention.py)

Every layer is created from it in its final form (`models.llama`); nothing is swapped or patched
after loading.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from native_backend.kernels import cpu_kernels
from native_backend.model.attention import AttentionBackend, get_attention_backend
from native_backend.model.layers import prefill_attention, prefill_matmul
from native_backend.model.layers.prefill_matmul import BF16_MIN_ROWS
from native_backend.model.layers.linear import C_KERNEL, DENSE, CKernelMethod, LinearMethod, with_bf16_prefill
from native_backend.model.layers.ops import TORCH_OPS, TorchOps
from native_backend.model.layers.sharding import SINGLE, ShardSpec
from native_backend.model.layers.stages import WHOLE, StageSpec
from native_backend.model.quantization.format import QuantConfig


@dataclass(frozen=True)
class LayerContext:
    device: torch.device
    dtype: torch.dtype  # weights and activations
    linear_method: LinearMethod
    ops: TorchOps
    attention: AttentionBackend
    shard: ShardSpec = field(default=SINGLE)
    fuse_decode: bool = False  # CPU: whole decode steps through one C call (models.fused_decode)
    kernels: str = ""  # what was chosen, for the engine's start-up line
    head_method: LinearMethod | None = None  # the LM head's, when not linear_method (int4 models)
    int8_head: bool = True  # int4 models with the C kernels: logits from an int8 copy of the head
    gguf_q4: bool = False  # a GGUF's Q4_0 / Q4_1 linears run packed by the int4 method (else made float)
    prefill_matmul: str = "fp32"  # the setting (auto | fp32 | bf16); resolved for float and int4 linears
    prefill_note: str = ""  # what it and prefill_attention resolved to, for the start-up line
    prefill_attention: str = "fp32"  # the setting (auto | fp32 | bf16), resolved with prefill_matmul
    decode_matmul: str = "fp32"  # the setting (auto | fp32 | bf16), resolved with prefill_matmul
    # Rows from which products run in bf16 (prefill_matmul.BF16_MIN_ROWS, or DECODE_BF16_MIN_ROWS where decode
    # steps do too); the one-call decode step leaves steps of that many rows to the per-layer path
    bf16_min_rows: int = BF16_MIN_ROWS
    kernel_path: str = ""  # the C kernels' path (cpu_kernels.path(): "avx512", "avx2"); "": no C kernels
    prefill_path: str = ""  # CPU float32: "matmuls bf16, attention bf16" etc., as resolved; "": no choice made
    stage: StageSpec = field(default=WHOLE)  # the decoder layers this pipeline stage holds

    @classmethod
    def for_device(cls, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, *,
                   cpu_kernels: bool = True, attention: str | None = None,
                   shard: ShardSpec = SINGLE, stage: StageSpec = WHOLE) -> LayerContext:
        """`attention` forces a backend ("reference", "cpu", "triton"); by default the device's."""
        device = torch.device(device)
        if device.type != "cpu":
            backend = get_attention_backend(device, attention)
            return cls(device, dtype, DENSE, TORCH_OPS, backend, shard, kernels=f"attention {backend.name}",
                       stage=stage)
        if not cpu_kernels:
            backend = get_attention_backend(device, attention or "reference")
            return cls(device, dtype, DENSE, TORCH_OPS, backend, shard, kernels="torch kernels (C kernels off)",
                       stage=stage)
        return _cpu_context(device, dtype, attention, shard, stage)

    def with_prefill_matmul(self, setting: str) -> LayerContext:
        """This context with prefill's matrix products as `setting` says (prefill_matmul.resolve):
        float linears decided here (their twin that runs prefill chunks in bf16, the LM head kept
        on the float32 path), int4 ones by with_quantization once the checkpoint's format is known."""
        bf16, note = prefill_matmul.resolve(setting, device=self.device, dtype=self.dtype, int4=False)
        rows, decode_note = prefill_matmul.resolve_decode(self.decode_matmul, prefill_bf16=bf16, device=self.device,
                                                          dtype=self.dtype)
        ctx = dataclasses.replace(self, prefill_matmul=setting, bf16_min_rows=rows)._with_prefill_attention(
            bf16, "; ".join(n for n in (note, decode_note) if n))
        if not bf16:
            return ctx
        return dataclasses.replace(ctx, linear_method=with_bf16_prefill(self.linear_method, rows),
                                   head_method=self.head_method or self.linear_method)

    def with_quantization(self, quant: QuantConfig | None) -> LayerContext:
        """This context for a checkpoint quantized as `quant` (None: float, unchanged): the decoder's
        linears int4 AWQ (the C kernel where this context runs C-kernel linears), the LM head kept
        in float as AWQ checkpoints store it, with an int8 copy for the logits on the CPU
        (`int8_head`; the C kernel, or torch on the same numbers); one-call decode steps stay where
        the int4 C kernel runs (the step calls it), else decode steps run per layer."""
        if quant is None:
            return self
        from native_backend.model.quantization.method import Int8HeadMethod, int4_method  # imports layers.linear

        kernel = isinstance(self.linear_method, CKernelMethod) and cpu_kernels.int4_available()
        bf16, note = prefill_matmul.resolve(self.prefill_matmul, device=self.device, dtype=self.dtype, int4=True)
        rows, decode_note = prefill_matmul.resolve_decode(self.decode_matmul, prefill_bf16=bf16, device=self.device,
                                                          dtype=self.dtype)
        method = int4_method(quant, kernel=kernel, triton=self.device.type == "cuda", prefill_bf16=bf16,
                             bf16_min_rows=rows)
        int8_head = self.int8_head and self.device.type == "cpu" and self.dtype == torch.float32
        head_rows = rows if rows < prefill_matmul.BF16_MIN_ROWS else 0  # the head's own bf16 copy: decode's
        head = Int8HeadMethod(kernel=kernel, bf16_min_rows=head_rows) if int8_head else \
            self.head_method or self.linear_method
        fuse = self.fuse_decode and kernel
        kernels = self.kernels if fuse else self.kernels.replace(", one-call decode steps", "")
        ctx = dataclasses.replace(self, linear_method=method, head_method=head, fuse_decode=fuse, bf16_min_rows=rows,
                                  kernels=f"{kernels}; linears {method.name}, LM head {head.name}")
        return ctx._with_prefill_attention(bf16, "; ".join(n for n in (note, decode_note) if n))

    def _with_prefill_attention(self, bf16_matmuls: bool, matmul_note: str) -> LayerContext:
        """This context's attention backend with prompt chunks in bf16 or fp32 as prefill_attention
        says, given how the prefill matmuls resolved; both in the start-up note."""
        bf16, note = prefill_attention.resolve(self.prefill_attention, device=self.device, dtype=self.dtype,
                                               bf16_matmuls=bf16_matmuls)
        if bf16 and self.attention.name != "cpu":
            bf16, note = False, f"prefill attention fp32 (attention '{self.attention.name}' has no bf16 path)"
        attention = get_attention_backend(self.device, self.attention.name, prefill_bf16=bf16)
        chosen = self.device.type == "cpu" and self.dtype == torch.float32  # else the model's dtype runs
        path = f"matmuls {'bf16' if bf16_matmuls else 'fp32'}, attention {'bf16' if bf16 else 'fp32'}" if chosen else ""
        return dataclasses.replace(self, attention=attention, prefill_path=path,
                                   prefill_note="; ".join(n for n in (matmul_note, note) if n))


def _cpu_context(device, dtype, attention, shard, stage) -> LayerContext:
    backend = get_attention_backend(device, attention)
    if not cpu_kernels.available():
        why = cpu_kernels.unavailable_reason()
        return LayerContext(device, dtype, DENSE, TORCH_OPS, backend, shard,
                            kernels=f"torch kernels (C kernels unavailable: {why})", stage=stage)
    from native_backend.model.layers.cpu_ops import KERNEL_OPS  # imports the kernel library's bindings

    # The one-call decode step runs float32 weights over the C attention kernel only, the whole
    # model on one rank (it starts from the embedding and ends with the final norm).
    fuse = dtype == torch.float32 and backend.name == "cpu" and shard.size == 1 and stage.size == 1
    fused = ", one-call decode steps" if fuse else ""
    return LayerContext(device, dtype, C_KERNEL, KERNEL_OPS, backend, shard, fuse_decode=fuse, stage=stage,
                        kernel_path=cpu_kernels.path().name,
                        kernels=f"C kernels {cpu_kernels.path_label()} (attention '{backend.name}', "
                                f"C-kernel linears, fused layer ops{fused})")
