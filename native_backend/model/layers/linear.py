"""Linear layers built in their final form: a *method* says how the weight is stored and applied,
a *shard spec* says which part of the full matrix this rank holds.

    method (how):   DenseMethod   F.linear (MKL on the CPU, cuBLAS on CUDA)
                    CKernelMethod kvgate's C kernel for a few rows (decode), F.linear beyond
                    either with prefill_bf16: prefill-sized chunks in bf16 from a bf16 copy of the
                    weight (layers/prefill_matmul.py)
                    AWQLinearMethod (quantization/method.py): packed int4 qweight/qzeros/scales
    shard (which):  ColumnParallelLinear  output rows split:  W[rank*n/size : (rank+1)*n/size, :]
                    RowParallelLinear     input columns split: W[:, rank*k/size : (rank+1)*k/size],
                                          partial sums all-reduced, bias added once after

The shape of vLLM's `quant_method` (`create_weights` / `apply` / `process_weights_after_loading`)
and nano-vllm's `layers/linear.py`. The loader never builds a full float model: it calls each
parameter's `weight_loader` with one checkpoint tensor, and the parameter copies in its shard.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from native_backend.kernels import cpu_kernels
from native_backend.model.layers import prefill_matmul
from native_backend.model.layers.sharding import ShardSpec, default_weight_loader

# Rows up to which the C kernel beats MKL on the 2-core AVX2 box we measure on: 1.4-3x at 1-64
# rows, 1.1-1.2x at 96-224 over the model's layers, MKL ahead from 256 (bench/engine_step_bench.py's
# linear sweep, and a layers-only sweep at 96-256 rows).
KERNEL_MAX_ROWS = 224


class LinearMethod:
    """How a linear layer's weights are created, finished after loading, and applied."""

    name = "abstract"

    def create_weights(self, layer: "LinearBase", out_features: int, in_features: int, bias: bool,
                       dtype: torch.dtype, device: torch.device) -> None:
        raise NotImplementedError

    def process_weights_after_loading(self, layer: "LinearBase") -> None:
        """Called once every checkpoint tensor is in: repack, transpose, check."""

    def apply(self, layer: "LinearBase", x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class DenseMethod(LinearMethod):
    """A float weight (out, in) in the model's dtype, applied with F.linear; with `prefill_bf16`,
    prefill-sized chunks multiply a bf16 copy of it (made once after loading: 2 bytes a weight)."""

    name = "dense"

    def __init__(self, *, prefill_bf16: bool = False, bf16_min_rows: int = prefill_matmul.BF16_MIN_ROWS):
        self.prefill_bf16 = prefill_bf16
        self.bf16_min_rows = bf16_min_rows  # DECODE_BF16_MIN_ROWS with decode_matmul bf16: decode steps too

    def create_weights(self, layer, out_features, in_features, bias, dtype, device):
        layer.register_parameter("weight", nn.Parameter(
            torch.empty(out_features, in_features, dtype=dtype, device=device), requires_grad=False))
        layer.register_parameter("bias", nn.Parameter(
            torch.empty(out_features, dtype=dtype, device=device), requires_grad=False) if bias else None)

    def process_weights_after_loading(self, layer):
        if self.prefill_bf16:
            prefill_matmul.keep_bf16_copy(layer, layer._parameters["weight"])

    def apply(self, layer, x):
        params = layer._parameters  # one dict read; `layer.weight` goes through nn.Module.__getattr__
        if self.prefill_bf16 and prefill_matmul.takes(x, self.bf16_min_rows):
            return prefill_matmul.linear(x, layer, params["bias"])
        return F.linear(x, params["weight"], params["bias"])


class CKernelMethod(DenseMethod):
    """The dense weight, multiplied by kvgate's C kernel while the batch has few rows.

    A decode step multiplies a few rows by every weight of the model: it is weight reads, nothing
    else. MKL reaches about a third of the memory bandwidth there on the CPU we measured, the C
    kernel most of it; longer prefill chunks keep F.linear (MKL's blocked GEMM)."""

    name = "C kernel"

    def apply(self, layer, x):
        params = layer._parameters
        w, b = params["weight"], params["bias"]
        if self.prefill_bf16 and prefill_matmul.takes(x, self.bf16_min_rows):  # bf16 wins from its rows on
            return prefill_matmul.linear(x, layer, b)
        if _kernel_fits(x, w, b):
            return cpu_kernels.linear_unchecked(x, w, b)
        return F.linear(x, w, b)


def _kernel_fits(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> bool:
    """Called for every projection of every step: the cheap tests on x first."""
    return (x.dim() == 2 and x.shape[0] <= KERNEL_MAX_ROWS and x.dtype == torch.float32
            and x.device.type == "cpu" and not torch.is_grad_enabled() and w.shape[1] % 8 == 0
            and w.dtype == torch.float32 and w.device.type == "cpu" and w.is_contiguous()
            and (b is None or (b.dtype == torch.float32 and b.is_contiguous())))


DENSE = DenseMethod()
C_KERNEL = CKernelMethod()
DENSE_BF16_PREFILL = DenseMethod(prefill_bf16=True)
C_KERNEL_BF16_PREFILL = CKernelMethod(prefill_bf16=True)


def with_bf16_prefill(method: LinearMethod, min_rows: int = prefill_matmul.BF16_MIN_ROWS) -> LinearMethod:
    """The float method that runs products of `min_rows` rows and more in bf16 (a DENSE or C_KERNEL in, its
    twin out): prefill-sized chunks, and with decode_matmul bf16 the decode steps of DECODE_BF16_MIN_ROWS rows."""
    if min_rows == prefill_matmul.BF16_MIN_ROWS:
        return C_KERNEL_BF16_PREFILL if isinstance(method, CKernelMethod) else DENSE_BF16_PREFILL
    return type(method)(prefill_bf16=True, bf16_min_rows=min_rows)


class LinearBase(nn.Module):
    """y = x W^T + b over this rank's part of W. Subclasses say which part (`_shard_dims`)."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, method: LinearMethod,
                 shard: ShardSpec, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.shard = shard
        self.in_features, self.out_features = self._shard_dims(in_features, out_features)
        self.full_in_features, self.full_out_features = in_features, out_features
        self.method = method
        method.create_weights(self, self.out_features, self.in_features, bias, dtype, device)
        for param in self._parameters.values():
            if param is not None:
                param.weight_loader = self.weight_loader

    def _shard_dims(self, in_features: int, out_features: int) -> tuple[int, int]:
        return in_features, out_features

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        default_weight_loader(param, loaded)

    def process_weights_after_loading(self) -> None:
        self.method.process_weights_after_loading(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, method={self.method.name}, "
                f"shard={self.shard.rank}/{self.shard.size}")


class ReplicatedLinear(LinearBase):
    """Every rank holds the whole matrix (small layers, or a single device)."""


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; each rank's output is its slice (no communication)."""

    def _shard_dims(self, in_features, out_features):
        return in_features, self.shard.part(out_features, "output features")

    def weight_loader(self, param, loaded):
        # weight (out, in) and bias (out,) are both cut along dim 0; a packed int4 parameter
        # (in, out/8) says where its output dimension is
        default_weight_loader(param, self.shard.narrow(loaded, getattr(param, "output_dim", 0)))


class RowParallelLinear(LinearBase):
    """Input features split across ranks: each rank computes a partial sum of the full output,
    summed by one all-reduce; the bias is added once, after the sum."""

    def _shard_dims(self, in_features, out_features):
        return self.shard.part(in_features, "input features"), out_features

    def weight_loader(self, param, loaded):
        # the weight (out, in) is cut along dim 1, a packed int4 parameter along its input_dim;
        # the bias is whole on every rank
        dim = getattr(param, "input_dim", 1 if loaded.dim() == 2 else None)
        if dim is not None:
            loaded = self.shard.narrow(loaded, dim)
        default_weight_loader(param, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.shard.size == 1:
            return self.method.apply(self, x)
        bias = self._parameters["bias"]
        self._parameters["bias"] = None  # partial sums without it, then added once after the reduce
        try:
            y = self.method.apply(self, x)
        finally:
            self._parameters["bias"] = bias
        y = self.shard.all_reduce(y)
        return y if bias is None else y + bias
