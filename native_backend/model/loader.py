"""Load a Llama-family model from a Hugging Face safetensors directory or a GGUF file.

The model is built in its final form first (`LayerContext`: device, dtype, kernels, shard), then
each checkpoint tensor is read on its own and handed to its parameter's `weight_loader` under its
Hugging Face name: at no point does a whole float copy of the checkpoint exist beside the model.

GGUF tensors are dequantized to float with the `gguf` package, except, in a context with
`gguf_q4`, the decoder linears of a file that stores them all as Q4_0 / Q4_1: those are repacked as
stored into the int4 method's layout (quantization/gguf_int4.py), never made float. llama.cpp's converter permutes the
rows of attn_q / attn_k so that its rotary kernel can rotate adjacent pairs (x0, x1); our RoPE,
like Hugging Face's, rotates halves (x_i, x_{i+d/2}), so those rows are permuted back exactly as
transformers' `LlamaTensorProcessor._reverse_permute_weights` does.
"""

from __future__ import annotations

import dataclasses
import glob
import os
from collections.abc import Iterator

import torch

from native_backend.config.default_model import default_gguf_path
from native_backend.config.model import ModelConfig
from native_backend.model.layers.context import LayerContext
from native_backend.model.layers.rotary import unpermute_rotary_rows
from native_backend.model.layers.sharding import LazyTensor
from native_backend.model.models import model_class
from native_backend.model.models.llama import LlamaForCausalLM
from native_backend.model.quantization import gguf_int4
from native_backend.model.quantization.format import read_quant_config_file

NamedTensors = Iterator[tuple[str, torch.Tensor]]

def load_model(path: str | None = None, ctx: LayerContext | None = None) -> LlamaForCausalLM:
    """A `.gguf` file, or a directory with config.json + *.safetensors; None: the default model.
    `ctx`: what to build it with; None: float32 on the CPU with kvgate's CPU kernels."""
    path = path or default_gguf_path()
    if path.endswith(".gguf"):
        return load_gguf_model(path, ctx)
    return load_hf_model(path, ctx)


def read_model_config(path: str | None = None) -> ModelConfig:
    """The model's shape alone, without reading a weight."""
    path = path or default_gguf_path()
    if path.endswith(".gguf"):
        import gguf

        return ModelConfig.from_gguf(gguf.GGUFReader(path))
    return ModelConfig.from_hf_dir(path)


# ------------------------------------------------------------------------------ safetensors


def load_hf_model(model_dir: str, ctx: LayerContext | None = None) -> LlamaForCausalLM:
    """A quantized checkpoint (config.json's quantization_config: AWQ int4 GEMM) is built with the
    int4 linear method and loaded packed."""
    config = ModelConfig.from_hf_dir(model_dir)
    quant = read_quant_config_file(model_dir)
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    ctx = (ctx or LayerContext.for_device("cpu", torch.float32)).with_quantization(quant)
    lazy = ctx.shard.size > 1  # a tensor-parallel rank reads its slices only (packed int4 ones too)
    return build_model(config, safetensors_tensors(files, lazy=lazy), ctx)


def safetensors_tensors(files: list[str], *, lazy: bool = False) -> NamedTensors:
    """Every tensor of (possibly sharded) safetensors files, read one at a time; a damaged or
    truncated file is an error naming the file (and the tensor, once its header has been read).
    `lazy`: unread SafetensorsSlices instead, which read only the part a weight loader keeps."""
    from safetensors import SafetensorError, safe_open

    for file in files:
        try:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    if name.endswith("rotary_emb.inv_freq"):  # old checkpoints; we derive it from the config
                        continue
                    try:
                        tensor = SafetensorsSlice(f.get_slice(name), f"{file}: tensor {name}") if lazy \
                            else f.get_tensor(name)
                    except SafetensorError as exc:
                        raise ValueError(f"{file}: tensor {name} cannot be read: {exc}") from None
                    yield name, tensor
        except SafetensorError as exc:
            raise ValueError(f"{file}: not a readable safetensors file: {exc}") from None


class SafetensorsSlice(LazyTensor):
    """A safetensors tensor read on demand through `get_slice`: only the narrowed part is read."""

    def __init__(self, handle, what: str, index: tuple[slice, ...] | None = None):
        self.handle, self.what = handle, what
        full = tuple(handle.get_shape())
        self.index = index or tuple(slice(0, n) for n in full)
        self.shape = tuple(s.stop - s.start for s in self.index)

    def narrow(self, dim: int, start: int, length: int) -> SafetensorsSlice:
        index = list(self.index)
        first = index[dim].start + start
        index[dim] = slice(first, first + length)
        return SafetensorsSlice(self.handle, self.what, tuple(index))

    def read(self) -> torch.Tensor:
        from safetensors import SafetensorError

        try:
            return self.handle[self.index]
        except SafetensorError as exc:
            raise ValueError(f"{self.what} cannot be read: {exc}") from None


# ------------------------------------------------------------------------------ GGUF

# GGUF tensor name (after "blk.N.") -> Hugging Face name (after "model.layers.N.").
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def load_gguf_model(
    path: str, ctx: LayerContext | None = None, *, reader=None, num_layers: int | None = None
) -> LlamaForCausalLM:
    """`reader`: an already open `gguf.GGUFReader` (opening one parses the whole tokenizer, seconds).
    `num_layers`: keep only the first n decoder layers (early-exit drafts, quick tests)."""
    import gguf

    reader = reader or gguf.GGUFReader(path)
    config = ModelConfig.from_gguf(reader)
    model_class(config.architecture)  # an architecture we cannot build fails before any tensor is read
    if num_layers is not None:
        config = dataclasses.replace(config, num_layers=num_layers)
    ctx = ctx or LayerContext.for_device("cpu", torch.float32)
    q4 = gguf_int4.quant_config(reader, path) if ctx.gguf_q4 else None
    tensors = gguf_tensors(reader, config, packed_q4=q4 is not None, lazy=ctx.shard.size > 1)
    return build_model(config, tensors, ctx.with_quantization(q4))


def gguf_tensors(reader, config: ModelConfig, *, packed_q4: bool = False, lazy: bool = False) -> NamedTensors:
    """Dequantized float32 tensors under Hugging Face names, Q/K rows back in HF's order, one at
    a time (a quantized file is never expanded to float all at once); with packed_q4 the Q4_0 /
    Q4_1 linears as the int4 method's packed tensors instead (name.qweight, .scales, .offsets).
    `lazy` (a tensor-parallel rank): unread GGUFSlices, which dequantize only the rows and
    quantization blocks a weight loader keeps."""
    for tensor in reader.tensors:
        if tensor.name == "rope_freqs.weight":  # Llama 3.1 GGUFs: RoPE frequency factors
            raise NotImplementedError("GGUF rope_freqs (llama3 RoPE scaling) is not supported yet")
        name = hf_name_for_gguf(tensor.name)
        if name is None or _layer_index(name) >= config.num_layers:
            continue
        if packed_q4 and name.endswith("_proj.weight"):
            yield from gguf_int4.packed_tensors(name, tensor, _rotary_heads(name, config))
            continue
        heads = _rotary_heads(name, config)
        part = GGUFSlice(tensor.data, tensor.tensor_type, heads and tensor.data.shape[0] // heads)
        yield name, part if lazy else part.read()  # (out, in)


class GGUFSlice(LazyTensor):
    """A GGUF tensor dequantized on demand, only the part kept. The file's rows are the weight's
    output rows, so a row range is a slice of the raw rows; a column range is a slice of every
    row's quantization blocks when it falls on block edges (else the rows are dequantized whole,
    then cut). q/k rows (llama.cpp interleaves each head's rotary pairs) are un-permuted after the
    cut, which keeps whole heads: a rank's rows are whole heads."""

    def __init__(self, data, qtype, rotary_head_dim: int | None, rows=None, cols=None):
        self.data, self.qtype, self.rotary_head_dim = data, qtype, rotary_head_dim
        self.rows = rows or (0, data.shape[0])
        self.cols = cols or ((0, _gguf_layout(data, qtype)[0]) if data.ndim == 2 else None)
        self.shape = tuple(b - a for a, b in ((self.rows, self.cols) if self.cols else (self.rows,)))

    def narrow(self, dim: int, start: int, length: int) -> GGUFSlice:
        rows, cols = self.rows, self.cols
        if dim == 0:
            rows = (rows[0] + start, rows[0] + start + length)
        else:
            cols = (cols[0] + start, cols[0] + start + length)
        return GGUFSlice(self.data, self.qtype, self.rotary_head_dim, rows, cols)

    def read(self) -> torch.Tensor:
        raw = self.data[self.rows[0] : self.rows[1]]
        if self.cols is None:  # a vector: norms, biases
            w = dequantize_tensor(raw, self.qtype)
        else:
            full, block, unit = _gguf_layout(self.data, self.qtype)
            (a, b) = self.cols
            if (a, b) != (0, full) and a % block == 0 and b % block == 0:
                w = dequantize_tensor(raw[:, a // block * unit : b // block * unit], self.qtype)
            else:
                w = dequantize_tensor(raw, self.qtype)[:, a:b]
        if self.rotary_head_dim:  # q/k weights and biases
            w = unpermute_rotary_rows(w, w.shape[0] // self.rotary_head_dim)
        return w


def _gguf_layout(data, qtype) -> tuple[int, int, int]:
    """(columns, elements per block, entries of `data`'s rows per block): quantized and bf16
    rows are raw bytes, f32/f16 rows typed elements."""
    from gguf import GGML_QUANT_SIZES

    block, block_bytes = GGML_QUANT_SIZES[qtype]
    unit = block_bytes if data.dtype.itemsize == 1 else 1
    return data.shape[1] // unit * block, block, unit


def dequantize_tensor(data, qtype) -> torch.Tensor:
    """float32 (rows, cols). The common llama.cpp formats are unpacked here with torch, ~20x
    faster than `gguf.quants.dequantize` (numpy, row groups); anything else goes through it."""
    import numpy as np
    from gguf import GGMLQuantizationType as Q

    if qtype in (Q.F32, Q.F16, Q.BF16):
        if qtype == Q.BF16:  # numpy has no bfloat16: gguf hands the raw bits as uint8
            return torch.from_numpy(np.array(data)).view(torch.bfloat16).float()
        return torch.from_numpy(np.array(data)).float()
    unpack = _TORCH_DEQUANT.get(qtype.name)
    if unpack is None:
        from gguf.quants import dequantize

        return torch.from_numpy(dequantize(data, qtype).copy())
    raw = torch.from_numpy(np.array(data))  # (rows, bytes_per_row) uint8
    return unpack(raw).reshape(raw.shape[0], -1)


def _f16_at(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """(num_blocks, 1) float32 from the little-endian fp16 at byte `offset` of every block."""
    return blocks[:, offset : offset + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """llama.cpp packs element j in the low nibble of byte j, element j+16 in its high nibble."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=1).float()  # (num_blocks, 32)


def _dequant_q8_0(raw):  # block of 32: fp16 d, 32 x int8 q -> d * q
    blocks = raw.reshape(-1, 34)
    return _f16_at(blocks, 0) * blocks[:, 2:].contiguous().view(torch.int8).float()


def _dequant_q4_0(raw):  # block of 32: fp16 d, 16 bytes of nibbles -> d * (q - 8)
    blocks = raw.reshape(-1, 18)
    return _f16_at(blocks, 0) * (_nibbles(blocks[:, 2:]) - 8.0)


def _dequant_q4_1(raw):  # block of 32: fp16 d, fp16 m, 16 bytes of nibbles -> d * q + m
    blocks = raw.reshape(-1, 20)
    return _f16_at(blocks, 0) * _nibbles(blocks[:, 4:]) + _f16_at(blocks, 2)


_TORCH_DEQUANT = {"Q8_0": _dequant_q8_0, "Q4_0": _dequant_q4_0, "Q4_1": _dequant_q4_1}


def hf_name_for_gguf(gguf_name: str) -> str | None:
    """"blk.3.attn_q.weight" -> "model.layers.3.self_attn.q_proj.weight"; None if not ours."""
    base, _, kind = gguf_name.rpartition(".")  # kind: weight | bias
    parts = base.split(".")
    if parts[0] == "blk" and len(parts) == 3 and parts[2] in _GGUF_LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}.{kind}"
    if base in _GGUF_GLOBAL_NAMES:
        return f"{_GGUF_GLOBAL_NAMES[base]}.{kind}"
    return None  # e.g. rope_freqs: not supported yet


def _rotary_heads(name: str, config: ModelConfig) -> int | None:
    """The heads whose rows llama.cpp permuted in this weight (q, k), else None."""
    return config.num_heads if ".q_proj." in name else config.num_kv_heads if ".k_proj." in name else None


def _layer_index(name: str) -> int:
    return int(name.split(".")[2]) if name.startswith("model.layers.") else -1


# ------------------------------------------------------------------------------ materialise


def build_model(config: ModelConfig, weights: NamedTensors, ctx: LayerContext | None = None) -> LlamaForCausalLM:
    """The model in its final form for `ctx`, its parameters filled from `weights` one tensor at a
    time; raises on a missing or unexpected tensor."""
    ctx = ctx or LayerContext.for_device("cpu", torch.float32)
    model = model_class(config.architecture)(config, ctx)
    model.load_weights(weights)
    model.process_weights_after_loading()
    return model
