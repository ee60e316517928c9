"""The int4 AWQ linear method: a layer created with the packed AutoAWQ GEMM tensors, loaded packed
(and sharded packed), and applied by a kernel that dequantizes inside, so the model never holds a
float copy of the weight.

    create_weights:  qweight int32 (in, out/8), qzeros int32 (in/g, out/8), scales fp16 (in/g, out)
                     [, bias (out,)]; each marks its input and output dimension for the shard
                     loaders (the transpose of a dense weight's: output is dim 1 here)
    apply:           C kernel (cpu_kernels.int4_linear) for up to KERNEL_MAX_ROWS float32 rows on
                     the CPU; the Triton kernel (triton_int4.py, both variants) on CUDA (not yet run
                     on a GPU: tested under TRITON_INTERPRET=1); otherwise the reference: dequantize
                     then matmul. Like vLLM's AWQ path, a long prefill chunk pays for one transient
                     dequantized matrix and gets a BLAS GEMM for it. With `prefill_bf16`, a
                     prefill-sized chunk goes first to a bf16 GEMM over a bf16 copy of the
                     dequantized weight, made once after loading (layers/prefill_matmul.py: 2 bytes
                     a weight resident, beside the packed 0.5-0.6)
"""

from __future__ import annotations

import torch
from torch import nn

from native_backend.kernels import cpu_kernels
from native_backend.model.layers import prefill_matmul
from native_backend.model.layers.linear import DenseMethod, LinearMethod
from native_backend.model.quantization import reference
from native_backend.model.quantization.format import PACK, valid_group_sizes

# The C kernel re-unpacks the weight for every tile of 4 rows; dequantize + MKL GEMM pays for one
# float copy of the weight per call. On the 2-core box they were even at 512 rows (the engine's
# default step budget), so the kernel takes every chunk up to there.
KERNEL_MAX_ROWS = 512


class AWQLinearMethod(LinearMethod):
    """Int4 weights with a zero point and an fp16 scale per group of `group_size` inputs."""

    label = "int4 AWQ"  # the format, in names and load errors

    def __init__(self, group_size: int, *, kernel: bool, triton: bool = False, prefill_bf16: bool = False,
                 bf16_min_rows: int = prefill_matmul.BF16_MIN_ROWS):
        self.group_size = group_size
        self.bf16_min_rows = bf16_min_rows  # DECODE_BF16_MIN_ROWS with decode_matmul bf16: decode steps too
        self.kernel = kernel  # the C kernel for few rows (CPU, where it builds)
        self.triton = triton  # the Triton kernel (CUDA)
        self.prefill_bf16 = prefill_bf16  # prefill-sized chunks: a bf16 GEMM over a bf16 copy of the weight
        how = "Triton" if triton else "C kernel" if kernel else "torch reference"
        self.name = f"{self.label} g{group_size} ({how})"

    def create_weights(self, layer, out_features, in_features, bias, dtype, device):
        g = self.group_size
        if in_features % g:
            raise ValueError(f"{self.label}: group size {g} does not divide a layer's input width {in_features} "
                             f"(group sizes that do: {valid_group_sizes(in_features)})")
        if out_features % PACK:
            raise ValueError(f"{self.label}: {out_features} output features is not a multiple of {PACK}")
        if self.triton and (g < 16 or g & (g - 1)):  # refused at load, not mid-request
            raise ValueError(f"{self.label} on CUDA: group size {g} is not a power of two >= 16 "
                             "(the Triton kernel's tiles)")
        shapes = {"qweight": ((in_features, out_features // PACK), torch.int32),
                  "qzeros": ((in_features // g, out_features // PACK), torch.int32),
                  "scales": ((in_features // g, out_features), torch.float16)}
        for name, (shape, param_dtype) in shapes.items():
            param = nn.Parameter(torch.empty(shape, dtype=param_dtype, device=device), requires_grad=False)
            param.input_dim, param.output_dim = 0, 1  # for Column/RowParallelLinear's weight loaders
            layer.register_parameter(name, param)
        layer.register_parameter("bias", nn.Parameter(
            torch.empty(out_features, dtype=dtype, device=device), requires_grad=False) if bias else None)

    def process_weights_after_loading(self, layer):
        scales = layer._parameters["scales"]
        if not torch.isfinite(scales).all():
            raise ValueError(f"int4 AWQ: a layer of {layer.full_in_features} -> {layer.full_out_features} "
                             "has non-finite scales")
        if self.prefill_bf16:
            prefill_matmul.keep_bf16_copy(layer, self.dequantized(layer).t())  # (out, in)

    def dequantized(self, layer) -> torch.Tensor:
        """(in, out) float32: the reference's reading of the packed weight."""
        p = layer._parameters
        return reference.dequantize(p["qweight"], p["qzeros"], p["scales"])

    def apply(self, layer, x):
        p = layer._parameters
        qweight, qzeros, scales, bias = p["qweight"], p["qzeros"], p["scales"], p["bias"]
        rows = x.reshape(-1, x.shape[-1])  # (tokens, in)
        if self.prefill_bf16 and prefill_matmul.takes(rows, self.bf16_min_rows):
            y = prefill_matmul.linear(rows, layer, bias)
        elif self.kernel and _kernel_fits(rows, bias):
            y = cpu_kernels.int4_linear_unchecked(rows, qweight, qzeros, scales, bias)
        elif self.triton and rows.is_cuda:
            from native_backend.model.quantization import triton_int4  # imports triton: CUDA only

            y = triton_int4.int4_linear(rows, qweight, qzeros, scales, bias)
        else:
            y = reference.int4_linear(rows, qweight, qzeros, scales, bias)
        return y.reshape(*x.shape[:-1], y.shape[-1])


class Int4OffsetMethod(AWQLinearMethod):
    """The offset variant of the int4 method: GGUF's Q4_0 / Q4_1 blocks (32 weights, fp16 d and,
    for Q4_1, an fp16 minimum m) repacked at load into the same packed layout, with a float offset
    per group in place of the zero point (quantization/gguf_int4.py):

        qweight int32 (in, out/8)  AWQ's nibble order     W[i, o] = q * s + off
        scales  fp16 (in/g, out)   d                      Q4_1: off = m;  Q4_0: off = -8 d
        offsets fp16 (in/g, out)

    Applied as the zero-point method is: the C kernel (kvgate_int4_linear_off_f32) on the CPU, the
    Triton kernel's offset variant (triton_int4.int4_linear_offset) on CUDA, else the reference."""

    def __init__(self, group_size: int, *, kernel: bool, triton: bool = False, prefill_bf16: bool = False,
                 bf16_min_rows: int = prefill_matmul.BF16_MIN_ROWS, source: str = "GGUF Q4"):
        self.label = f"int4 {source}"
        super().__init__(group_size, kernel=kernel, triton=triton, prefill_bf16=prefill_bf16,
                         bf16_min_rows=bf16_min_rows)

    def create_weights(self, layer, out_features, in_features, bias, dtype, device):
        super().create_weights(layer, out_features, in_features, bias, dtype, device)
        offsets = nn.Parameter(torch.empty_like(layer._parameters["scales"]), requires_grad=False)
        offsets.input_dim, offsets.output_dim = 0, 1
        del layer._parameters["qzeros"]
        layer.register_parameter("offsets", offsets)

    def process_weights_after_loading(self, layer):
        if not torch.isfinite(layer._parameters["offsets"]).all():
            raise ValueError(f"int4 GGUF: a layer of {layer.full_in_features} -> {layer.full_out_features} "
                             "has non-finite offsets")
        super().process_weights_after_loading(layer)

    def dequantized(self, layer) -> torch.Tensor:
        p = layer._parameters
        return reference.dequantize_offset(p["qweight"], p["offsets"], p["scales"])

    def apply(self, layer, x):
        p = layer._parameters
        qweight, offsets, scales, bias = p["qweight"], p["offsets"], p["scales"], p["bias"]
        rows = x.reshape(-1, x.shape[-1])
        if self.prefill_bf16 and prefill_matmul.takes(rows, self.bf16_min_rows):
            y = prefill_matmul.linear(rows, layer, bias)
        elif self.kernel and _kernel_fits(rows, bias):
            y = cpu_kernels.int4_linear_off_unchecked(rows, qweight, offsets, scales, bias)
        elif self.triton and rows.is_cuda:
            from native_backend.model.quantization import triton_int4  # imports triton: CUDA only

            y = triton_int4.int4_linear_offset(rows, qweight, offsets, scales, bias)
        else:
            y = reference.int4_linear_offset(rows, qweight, offsets, scales, bias)
        return y.reshape(*x.shape[:-1], y.shape[-1])


def int4_method(quant, *, kernel: bool, triton: bool, prefill_bf16: bool = False,
                bf16_min_rows: int = prefill_matmul.BF16_MIN_ROWS) -> AWQLinearMethod:
    """The int4 method of a QuantConfig: AWQ's zero points, or GGUF Q4's offsets ("gguf Q4_1")."""
    bf16 = {"prefill_bf16": prefill_bf16, "bf16_min_rows": bf16_min_rows}
    if quant.quant_method.startswith("gguf"):
        return Int4OffsetMethod(quant.group_size, kernel=kernel, triton=triton,
                                source=quant.quant_method.replace("gguf", "GGUF"), **bf16)
    return AWQLinearMethod(quant.group_size, kernel=kernel, triton=triton, **bf16)


def _kernel_fits(x: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Per call: the weights were checked once (created here, loaded through the shard loaders)."""
    return (x.shape[0] <= KERNEL_MAX_ROWS and x.dtype == torch.float32 and x.device.type == "cpu"
            and not torch.is_grad_enabled() and (bias is None or bias.dtype == torch.float32))


def describe_weights(model) -> str:
    """The start-up line's weights: resident bytes, and the linears' format when int4."""
    total = sum(t.numel() * t.element_size() for t in (*model.parameters(), *_weight_buffers(model)))
    copies = _copies_mib(model)
    awq = [m for m in model.modules() if isinstance(getattr(m, "method", None), AWQLinearMethod)]
    if not awq:
        return f"weights {total / 2**20:.0f} MiB" + (f" ({copies.lstrip(', ')})" if copies else "")
    packed = sum(p.numel() * p.element_size() for m in awq for p in m.parameters())
    return (f"weights {total / 2**20:.0f} MiB ({len(awq)} linears {awq[0].method.name}: {packed / 2**20:.0f} MiB; "
            f"embedding, norms and head in {model.ctx.dtype}{copies})".replace("torch.", ""))


def _copies_mib(model) -> str:
    """", the head's int8 copy 27 MiB, bf16 prefill copies of the linears 202 MiB, the head's bf16 copy 54 MiB"
    (those present; the head's bf16 copy is decode_matmul bf16's)."""
    named = {"weight_int8": "the head's int8 copy", "weight_scale": "the head's int8 copy",
             "weight_bf16": "bf16 prefill copies of the linears", "lm_head.weight_bf16": "the head's bf16 copy"}
    sizes: dict[str, int] = {}
    for name, b in model.named_buffers():
        label = named.get(name) or named.get(name.rsplit(".", 1)[-1])
        if label:
            sizes[label] = sizes.get(label, 0) + b.numel() * b.element_size()
    return "".join(f", {label} {n / 2**20:.0f} MiB" for label, n in sizes.items())


def weights_format(model) -> str:
    """The decoder linears' format in a few words: "float32", or the int4 method's ("int4 AWQ g64",
    "int4 GGUF Q4_1 g32"), for the engine's stats (the gateway's /v1/models)."""
    method = model.decoder_layers()[0].self_attn.q_proj.method
    if isinstance(method, AWQLinearMethod):
        return f"{method.label} g{method.group_size}"
    return str(model.ctx.dtype).replace("torch.", "")


def _weight_buffers(model) -> list[torch.Tensor]:
    """Weights held as buffers (the int8 copy of an int4 model's head, bf16 prefill's copies of the
    linears); a tied head's float weight is the embedding's and counted once with the parameters."""
    return [b for name, b in model.named_buffers() if name.endswith(("weight_int8", "weight_scale", "weight_bf16"))]


class Int8HeadMethod(DenseMethod):
    """The LM head of an int4 model: the float weight as loaded (a tied head shares it with the
    embedding, which looks rows up in it), plus an int8 copy with a scale per vocabulary row,
    made once after loading, that every logits call multiplies by (C kernel). A decode step reads
    the whole head: with int4 linears it is most of the bytes, and int8 reads a quarter of fp32's.

        scale[n] = max_k |W[n, k]| / 127,   W8[n, k] = round(W[n, k] / scale[n])
    """

    def __init__(self, *, kernel: bool, bf16_min_rows: int = 0):
        self.kernel = kernel  # the C kernel; else torch on the same int8 numbers
        # decode_matmul bf16: from this many rows a bf16 copy of the head (0: never). The int8 kernel streams
        # the head once per 1-2 rows and falls behind oneDNN's bf16 GEMM from ~16 rows (prefill_matmul.py).
        self.bf16_min_rows = bf16_min_rows
        bf16 = f", bf16 from {bf16_min_rows} rows" if bf16_min_rows else ""
        self.name = f"int8 rows ({'C kernel' if kernel else 'torch reference'}{bf16})"

    def process_weights_after_loading(self, layer):
        w = layer._parameters["weight"].detach().float()
        scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)  # (vocab,)
        layer.register_buffer("weight_int8", torch.round(w / scale[:, None]).to(torch.int8), persistent=False)
        layer.register_buffer("weight_scale", scale.contiguous(), persistent=False)
        if self.bf16_min_rows:
            prefill_matmul.keep_bf16_copy(layer, w)

    def apply(self, layer, x):
        w8, scale, bias = layer._buffers["weight_int8"], layer._buffers["weight_scale"], layer._parameters["bias"]
        if self.bf16_min_rows and x.dim() == 2 and prefill_matmul.takes(x, self.bf16_min_rows):
            return prefill_matmul.linear(x, layer, bias)
        if self.kernel and x.dtype == torch.float32 and x.device.type == "cpu" and not torch.is_grad_enabled() \
                and x.dim() == 2:
            y = cpu_kernels.int8_rows(x, w8, scale)
        else:  # the same numbers through torch
            y = x @ (w8.to(x.dtype) * scale[:, None].to(x.dtype)).t()
        return y if bias is None else y + bias

