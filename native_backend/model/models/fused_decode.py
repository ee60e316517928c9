"""A decode step's whole decoder stack in one C call (csrc/decode_step.c), on x86-64 CPUs.

Through Python a decode layer is ~13 kernel calls, each a ctypes call plus tensor checks: about
0.2 ms per layer, a third of a batch-1 step of the default model. `FusedDecode` hands the C
library a table of every layer's weight and cache pointers once, and then runs a step whose rows
are all short queries (decodes) with one call; it runs the same kernels in the same order as the
Python path, so the hidden states are bit-identical (tests/native_backend/test_cpu_decode.py).

A quantized cache (fp8, int8) goes through the quantized write and decode kernels, the ones the
"cpu" attention backend calls, so those steps too are bit-identical to the per-layer path. A layer
whose keys are stored minus an offset (KVLayer.k_offset: a calibrated fp8 cache, the default for
fp8) has it subtracted in C before the write, as Attention.forward subtracts it. So do
int4 AWQ linears (quantization/method.py with the C kernel): the table holds their packed tensors
and the step calls the int4 kernel the method calls.

The model is built in its final form, so its weights never move after loading: the table is
built once, when the model binds its KV cache (`FusedDecode.build`), from the model's declared
list of decoder layers. A model the kernels cannot take (not float32 weights and cache, odd
sizes, a linear method other than the C kernel's or the int4 C kernel's) gets no FusedDecode; a step they cannot take
(prefill rows, too many rows: with decode_matmul bf16, DECODE_BF16_MIN_ROWS and up) returns None and the
caller runs the Python path.
"""

from __future__ import annotations

import ctypes

import torch

from native_backend.kernels import cpu_kernels
from native_backend.model.attention import cpu as cpu_attention
from native_backend.model.layers import prefill_matmul
from native_backend.model.layers.cpu_ops import check_positions
from native_backend.model.layers.linear import KERNEL_MAX_ROWS, CKernelMethod
from native_backend.model.quantization.method import AWQLinearMethod

_f32p, _i64p, _i64, _f32 = ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_LINEAR_FIELDS = ("q", "k", "v", "o", "gate", "up", "down")  # kvg_layer's, in `_projections` order


class _Linear(ctypes.Structure):
    """kvg_linear: a float32 weight (w), or an int4 one (qweight, qzeros, scales, group; w NULL)."""

    _fields_ = [("w", _f32p), ("bias", _f32p), ("n", _i64), ("k", _i64), ("qweight", ctypes.c_void_p),
                ("qzeros", ctypes.c_void_p), ("scales", ctypes.c_void_p), ("offsets", ctypes.c_void_p),
                ("group", _i64)]

    @classmethod
    def of(cls, proj) -> _Linear:
        b = proj.bias.data_ptr() if proj.bias is not None else None
        if isinstance(proj.method, CKernelMethod):
            return cls(proj.weight.data_ptr(), b, proj.out_features, proj.in_features)
        p = proj._parameters  # int4: qzeros (AWQ) or offsets (GGUF Q4), checked by _fits
        ptr = lambda name: p[name].data_ptr() if name in p else None  # noqa: E731
        return cls(None, b, proj.out_features, proj.in_features, ptr("qweight"), ptr("qzeros"), ptr("scales"),
                   ptr("offsets"), proj.method.group_size)


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", _f32p), ("post_norm", _f32p)] + [
        (name, _Linear) for name in _LINEAR_FIELDS] + [
        ("cache_k", _f32p), ("cache_v", _f32p), ("kv", ctypes.c_void_p), ("k_offset", _f32p)]


class _Dims(ctypes.Structure):
    _fields_ = [(name, _i64) for name in
                ("hidden", "num_heads", "kv_heads", "head_dim", "intermediate", "block_size")] + [
        ("eps", _f32), ("scale", _f32)]


class _Step(ctypes.Structure):
    _fields_ = [(name, _i64p) for name in ("positions", "slots", "block_tables", "row_seq", "row_keys")] + [
        ("cos", _f32p), ("sin", _f32p), ("table_stride", _i64), ("chunk_blocks", _i64)]


class FusedDecode:
    def __init__(self, model, layers, dims: _Dims, keep_alive: list):
        self.embed = model.model.embed_tokens
        self.final_norm = model.model.norm.weight
        self.rotary = model.model.rotary_emb
        self.layers, self.dims = layers, dims
        # decode_matmul bf16: steps of this many rows multiply bf16 copies through oneDNN, on the per-layer path
        rows = model.ctx.bf16_min_rows
        self.max_rows = min(KERNEL_MAX_ROWS, rows - 1) if rows < prefill_matmul.BF16_MIN_ROWS else KERNEL_MAX_ROWS
        self._keep_alive = keep_alive  # every tensor whose pointer the table holds

    @classmethod
    def build(cls, model) -> FusedDecode | None:
        """The pointer table of a float32 Llama with C-kernel linears over the float32 KV layers
        bound to it; None when the model or its cache is not that (the Python path runs every step)."""
        layers = model.decoder_layers()
        if any(layer.self_attn.attn.kv is None for layer in layers):
            return None
        tensors = _tensors(model, layers)
        if not _fits(model, layers, tensors):
            return None
        table = (_Layer * len(layers))()
        for entry, layer in zip(table, layers):
            entry.input_norm = layer.input_layernorm.weight.data_ptr()
            entry.post_norm = layer.post_attention_layernorm.weight.data_ptr()
            kv = layer.self_attn.attn.kv
            entry.cache_k, entry.cache_v = kv.key.data_ptr(), kv.value.data_ptr()
            if kv.dtype.quantized:  # the struct the quantized kernels read, kept alive with the table
                quantized = cpu_attention.quantized_view(kv)
                quantized.check()
                struct = quantized.struct()
                tensors += [quantized, struct]
                entry.kv = ctypes.addressof(struct)
            if kv.k_offset is not None:  # checked by _fits, kept alive by the KV layer (and `tensors`)
                entry.k_offset = kv.k_offset.data_ptr()
            for proj, name in zip(_projections(layer), _LINEAR_FIELDS):
                setattr(entry, name, _Linear.of(proj))
        config, attn = model.config, layers[0].self_attn.attn
        dims = _Dims(config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim,
                     config.intermediate_size, attn.kv.block_size, model.model.norm.eps, attn.scale)
        return cls(model, table, dims, tensors)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, md) -> torch.Tensor | None:
        """The final hidden states (num_tokens, hidden) of a decode step, or None: run the Python path."""
        n = input_ids.shape[0]
        if (torch.is_grad_enabled() or n > self.max_rows or md.max_query_len > cpu_attention.SHORT_QUERY_MAX
                or input_ids.device.type != "cpu" or not _int64_rows(positions, md.slot_mapping, md.block_tables)):
            return None
        rotary = self.rotary
        check_positions(rotary, positions)
        plan = cpu_attention.step_plan(md, torch.float32, input_ids.device)
        tables, positions = md.block_tables, positions.contiguous()
        step = _Step(positions.data_ptr(), md.slot_mapping.data_ptr(), tables.data_ptr(), plan.row_seq.data_ptr(),
                     plan.row_keys.data_ptr(), rotary.cos.data_ptr(), rotary.sin.data_ptr(), tables.stride(0),
                     plan.chunk_blocks)
        h = self.embed(input_ids)  # (n, hidden): becomes the residual stream
        out = torch.empty_like(h)
        rc = cpu_kernels.load().kvgate_decode_layers_f32(
            ctypes.addressof(self.layers), len(self.layers), ctypes.byref(self.dims), ctypes.byref(step),
            self.final_norm.data_ptr(), h.data_ptr(), out.data_ptr(), n)
        if rc != 0:
            raise RuntimeError(f"kvgate_decode_layers_f32 failed ({rc})")
        return out


def _projections(layer) -> tuple:
    """A decoder layer's linears in the order of kvg_layer's fields."""
    attn, mlp = layer.self_attn, layer.mlp
    return attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj


def _tensors(model, layers) -> list[torch.Tensor | None]:
    tensors = [model.model.norm.weight, model.model.embed_tokens.weight]
    for layer in layers:
        kv = layer.self_attn.attn.kv
        tensors += [layer.input_layernorm.weight, layer.post_attention_layernorm.weight, kv.k_offset]
        if not kv.dtype.quantized:  # float32 caches are read as floats; quantized ones are checked on their own
            tensors += [kv.key, kv.value]
        for proj in _projections(layer):
            tensors += [proj.bias] + ([proj.weight] if isinstance(proj.method, CKernelMethod) else [])
    return tensors


def _fits(model, layers, tensors) -> bool:
    """A float32 Llama with the C-kernel linears, the C ops and the cpu attention, on one rank."""
    config, ctx = model.config, model.ctx
    if not (cpu_kernels.available() and ctx.fuse_decode and ctx.attention.name == "cpu" and ctx.shard.size == 1):
        return False
    if config.head_dim % 16 or config.hidden_size % 8 or config.intermediate_size % 8:
        return False
    kvs = [layer.self_attn.attn.kv for layer in layers]
    if any(not (kv.dtype.name == "float32" or kv.dtype.quantized) or kv.block_size != kvs[0].block_size
           or not _offset_fits(kv) for kv in kvs):
        return False
    norms_eps = {model.model.norm.eps} | {n.eps for layer in layers
                                          for n in (layer.input_layernorm, layer.post_attention_layernorm)}
    projections = [proj for layer in layers for proj in _projections(layer)]
    rotary = model.model.rotary_emb
    return (len(norms_eps) == 1
            and all(p.in_features % 8 == 0 and (isinstance(p.method, CKernelMethod) or _int4_fits(p))
                    for p in projections)
            and cpu_kernels.readable(*tensors, rotary.cos, rotary.sin, dtype=torch.float32))


def _offset_fits(kv) -> bool:
    """No key offset, or one the C step subtracts from each new key: (kv_heads, head_dim) float32
    (its layout checked with the other tensors by `readable`)."""
    return kv.k_offset is None or tuple(kv.k_offset.shape) == (kv.num_kv_heads, kv.head_dim)


def _int4_fits(proj) -> bool:
    """An int4 linear the step can run: the C kernel's method (the CPU has F16C) and its packed
    tensors as that kernel reads them (the method checked their shapes at load)."""
    p = proj._parameters
    return (isinstance(proj.method, AWQLinearMethod) and proj.method.kernel
            and cpu_kernels.readable(p["qweight"], p.get("qzeros"), dtype=torch.int32)
            and cpu_kernels.readable(p["scales"], p.get("offsets"), dtype=torch.float16))


def _int64_rows(*tensors: torch.Tensor) -> bool:
    """The C side reads these as int64 arrays (block-table rows contiguous)."""
    return all(t.dtype == torch.int64 and t.device.type == "cpu" and t.stride(-1) == 1 for t in tensors)
