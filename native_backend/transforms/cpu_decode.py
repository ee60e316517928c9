"""A decode step's whole decoder stack in one C call (csrc/decode_step.c), on x86-64 CPUs.

Through Python a decode layer is ~13 kernel calls, each a ctypes call plus tensor checks: about
0.2 ms per layer, a third of a batch-1 step of the default model. `FusedDecode` hands the C
library a table of every layer's weight and cache pointers once, and then runs a step whose rows
are all short queries (decodes) with one call; it runs the same kernels in the same order as the
Python path, so the hidden states are bit-identical (tests/native_backend/test_cpu_decode.py).

The table is rebuilt whenever a weight or cache tensor moved (a new KV cache, `model.to(...)`),
and a model or step the kernels cannot take (not float32, a transformed projection, prefill
rows, too many rows) returns None: the caller runs the Python path.
"""

from __future__ import annotations

import ctypes

import torch

from native_backend import cpu_kernels
from native_backend.attention import cpu as cpu_attention
from native_backend.transforms.cpu_linear import KERNEL_MAX_ROWS, KernelLinear
from native_backend.transforms.cpu_ops import KernelOps, check_positions

_f32p, _i64p, _i64, _f32 = ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_PROJECTIONS = (("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj"), ("self_attn", "o_proj"),
                ("mlp", "gate_proj"), ("mlp", "up_proj"), ("mlp", "down_proj"))
_LINEAR_FIELDS = ("q", "k", "v", "o", "gate", "up", "down")  # kvg_layer's, in _PROJECTIONS' order


class _Linear(ctypes.Structure):
    _fields_ = [("w", _f32p), ("bias", _f32p), ("n", _i64), ("k", _i64)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", _f32p), ("post_norm", _f32p)] + [
        (name, _Linear) for name in _LINEAR_FIELDS] + [
        ("cache_k", _f32p), ("cache_v", _f32p)]


class _Dims(ctypes.Structure):
    _fields_ = [(name, _i64) for name in
                ("hidden", "num_heads", "kv_heads", "head_dim", "intermediate", "block_size")] + [
        ("eps", _f32), ("scale", _f32)]


class _Step(ctypes.Structure):
    _fields_ = [(name, _i64p) for name in ("positions", "slots", "block_tables", "row_seq", "row_keys")] + [
        ("cos", _f32p), ("sin", _f32p), ("table_stride", _i64), ("chunk_blocks", _i64)]


class FusedDecode:
    def __init__(self, model: torch.nn.Module):
        self.model = model
        self._key: tuple | None = None  # the data pointers the table was built from
        self._table: tuple | None = None  # (layers array, dims) or None: the model does not fit

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache, md) -> torch.Tensor | None:
        """The final hidden states (num_tokens, hidden) of a decode step, or None: run the Python path."""
        n = input_ids.shape[0]
        if (torch.is_grad_enabled() or n > KERNEL_MAX_ROWS or md.max_query_len > cpu_attention.SHORT_QUERY_MAX
                or input_ids.device.type != "cpu" or not _int64_rows(positions, md.slot_mapping, md.block_tables)):
            return None
        table = self._table_for(kv_cache)
        if table is None:
            return None
        layers, dims = table
        rotary = self.model.model.rotary_emb
        check_positions(rotary, positions)
        plan = cpu_attention.step_plan(md, torch.float32, input_ids.device)
        tables, positions = md.block_tables, positions.contiguous()
        step = _Step(positions.data_ptr(), md.slot_mapping.data_ptr(), tables.data_ptr(), plan.row_seq.data_ptr(),
                     plan.row_keys.data_ptr(), rotary.cos.data_ptr(), rotary.sin.data_ptr(), tables.stride(0),
                     plan.chunk_blocks)
        h = self.model.model.embed_tokens(input_ids)  # (n, hidden): becomes the residual stream
        out = torch.empty_like(h)
        rc = cpu_kernels.load().kvgate_decode_layers_f32(
            ctypes.addressof(layers), len(layers), ctypes.byref(dims), ctypes.byref(step),
            self.model.model.norm.weight.data_ptr(), h.data_ptr(), out.data_ptr(), n)
        if rc != 0:
            raise RuntimeError(f"kvgate_decode_layers_f32 failed ({rc})")
        return out

    def _table_for(self, kv_cache):
        tensors = self._tensors(kv_cache)
        key = tuple(t.data_ptr() if t is not None else 0 for t in tensors)
        if key != self._key:
            self._key, self._table = key, self._build(kv_cache, tensors)
        return self._table

    def _tensors(self, kv_cache) -> list[torch.Tensor | None]:
        """Every tensor whose pointer the table holds, in a fixed order. This runs every step: it
        reads the modules' own dicts, which is what attribute access finds, without the cost of
        nn.Module.__getattr__ (half a millisecond per step over 30 layers)."""
        model = self.model.model
        tensors = [model.norm.weight, model.embed_tokens.weight, *kv_cache.key_caches, *kv_cache.value_caches]
        for layer in model.layers:
            modules = layer._modules
            tensors += [modules["input_layernorm"]._parameters["weight"],
                        modules["post_attention_layernorm"]._parameters["weight"]]
            for block, name in _PROJECTIONS:
                params = modules[block]._modules[name]._parameters
                tensors += [params["weight"], params["bias"]]
        return tensors

    def _build(self, kv_cache, tensors):
        model, config = self.model, self.model.config
        if not self._fits(kv_cache, tensors):
            return None
        layers = (_Layer * len(model.model.layers))()
        for i, layer in enumerate(model.model.layers):
            entry = layers[i]
            entry.input_norm = layer.input_layernorm.weight.data_ptr()
            entry.post_norm = layer.post_attention_layernorm.weight.data_ptr()
            entry.cache_k, entry.cache_v = (t.data_ptr() for t in kv_cache.layer(i))
            for (block, name), field in zip(_PROJECTIONS, _LINEAR_FIELDS):
                proj = getattr(getattr(layer, block), name)
                b = proj.bias
                setattr(entry, field, _Linear(proj.weight.data_ptr(), b.data_ptr() if b is not None else None,
                                              proj.out_features, proj.in_features))
        attn = model.model.layers[0].self_attn
        dims = _Dims(config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim,
                     config.intermediate_size, kv_cache.block_size, model.model.norm.eps, attn.scale)
        return layers, dims

    def _fits(self, kv_cache, tensors) -> bool:
        """A plain Llama in float32 with the kernel linears, the C ops and the cpu attention."""
        model, config = self.model, self.model.config
        if not (cpu_kernels.available() and isinstance(model.ops, KernelOps)
                and getattr(model.attn_backend, "name", None) == "cpu"):
            return False
        if config.head_dim % 16 or config.hidden_size % 8 or config.intermediate_size % 8:
            return False
        norms_eps = {model.model.norm.eps} | {n.eps for layer in model.model.layers
                                              for n in (layer.input_layernorm, layer.post_attention_layernorm)}
        projections = [getattr(getattr(layer, block), name) for layer in model.model.layers
                       for block, name in _PROJECTIONS]
        rotary = model.model.rotary_emb
        return (len(norms_eps) == 1 and all(type(p) is KernelLinear and p.in_features % 8 == 0 for p in projections)
                and cpu_kernels.readable(*tensors, rotary.cos, rotary.sin, dtype=torch.float32))


def _int64_rows(*tensors: torch.Tensor) -> bool:
    """The C side reads these as int64 arrays (block-table rows contiguous)."""
    return all(t.dtype == torch.int64 and t.device.type == "cpu" and t.stride(-1) == 1 for t in tensors)
