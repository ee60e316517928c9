"""One PEFT LoRA adapter (`save_pretrained`'s directory), read and checked against the base model.

    adapter_config.json         peft_type "LORA", r, lora_alpha, use_rslora, target_modules, ...
    adapter_model.safetensors   base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight  [r, in]
                                base_model.model.model.layers.N.self_attn.q_proj.lora_B.weight  [out, r]

The scale alpha / r (alpha / sqrt(r) with use_rslora) is folded into B once here, so a step
computes x @ A.T @ B.T. Everything we cannot honour is refused by name (LoRAError, a ValueError)
before any tensor reaches the engine: an engine never serves half an adapter.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field

import torch
from safetensors.torch import load_file

# The linears an adapter may target: module name -> its parent in a decoder layer.
TARGET_MODULES = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
                  "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight$")


class LoRAError(ValueError):
    """An adapter that cannot be served; the message names the adapter and the cause."""


@dataclass
class LoRAAdapter:
    name: str
    path: str
    rank: int  # the largest rank of its modules
    # (layer index, module name) -> (A [r, in], B*scale [out, r]) in the base model's dtype
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def load_adapter(name: str, path: str, model: torch.nn.Module, max_lora_rank: int) -> LoRAAdapter:
    """Read `path` and check every tensor against `model`'s linears; LoRAError on anything wrong."""
    config = _read_config(name, path)
    tensors = _read_tensors(name, path)
    shapes = _base_shapes(model)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            raise LoRAError(f"LoRA adapter '{name}': tensor {key} is not a LoRA A/B weight of a decoder linear")
        layer, parent, module, which = int(match[1]), match[2], match[3], match[4]
        if TARGET_MODULES.get(module) != parent:
            raise LoRAError(f"LoRA adapter '{name}': unknown target module {parent}.{module} "
                            f"(supported: {', '.join(TARGET_MODULES)})")
        pairs.setdefault((layer, module), {})[which] = tensor
    if not pairs:
        raise LoRAError(f"LoRA adapter '{name}': adapter_model.safetensors holds no LoRA weights")
    adapter = LoRAAdapter(name, path, rank=0)
    for (layer, module), ab in sorted(pairs.items()):
        a, b = _check_pair(name, layer, module, ab, shapes, max_lora_rank)
        scale = _scale(config, a.shape[0])
        dtype = shapes[(layer, module)][2]
        adapter.weights[(layer, module)] = (a.to(dtype).contiguous(), (b.double() * scale).to(dtype).contiguous())
        adapter.rank = max(adapter.rank, a.shape[0])
    return adapter


def _read_config(name: str, path: str) -> dict:
    file = os.path.join(path, "adapter_config.json")
    try:
        with open(file, encoding="utf-8") as f:
            config = json.load(f)
    except FileNotFoundError:
        raise LoRAError(f"LoRA adapter '{name}': no adapter_config.json in {path}") from None
    except (OSError, ValueError) as exc:
        raise LoRAError(f"LoRA adapter '{name}': adapter_config.json unreadable: {exc}") from None
    if not isinstance(config, dict):
        raise LoRAError(f"LoRA adapter '{name}': adapter_config.json is not an object")
    if config.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"LoRA adapter '{name}': peft_type {config.get('peft_type')!r} is not LORA")
    refused = {"modules_to_save": "modules_to_save (whole modules trained beside the LoRA)",
               "use_dora": "use_dora (DoRA)", "alpha_pattern": "alpha_pattern", "layers_to_transform": None}
    for key, what in refused.items():
        if what and config.get(key):
            raise LoRAError(f"LoRA adapter '{name}': {what} is not supported")
    for key in ("r", "lora_alpha"):
        value = config.get(key)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
            raise LoRAError(f"LoRA adapter '{name}': adapter_config.json {key} must be a positive number, "
                            f"not {value!r}")
    return config


def _read_tensors(name: str, path: str) -> dict[str, torch.Tensor]:
    file = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isfile(file):
        raise LoRAError(f"LoRA adapter '{name}': no adapter_model.safetensors in {path}")
    try:
        return load_file(file, device="cpu")
    except Exception as exc:  # noqa: BLE001 - any corrupt file is this adapter's fault alone
        raise LoRAError(f"LoRA adapter '{name}': adapter_model.safetensors unreadable: {exc}") from None


def _base_shapes(model: torch.nn.Module) -> dict[tuple[int, str], tuple[int, int, torch.dtype]]:
    """(layer, module) -> (in_features, out_features, dtype) of the base's target linears."""
    shapes, dtype = {}, model.ctx.dtype
    for i, layer in enumerate(model.model.layers):
        for module, parent in TARGET_MODULES.items():
            linear = getattr(getattr(layer, parent), module)
            shapes[(i, module)] = (linear.in_features, linear.out_features, dtype)
    return shapes


def _check_pair(name, layer, module, ab, shapes, max_lora_rank) -> tuple[torch.Tensor, torch.Tensor]:
    where = f"LoRA adapter '{name}': layers.{layer}.{module}"
    if "A" not in ab or "B" not in ab:
        raise LoRAError(f"{where} has lora_{'B' if 'A' in ab else 'A'} without lora_{'A' if 'A' in ab else 'B'}")
    if (layer, module) not in shapes:
        raise LoRAError(f"{where}: the base model has {len(shapes) // len(TARGET_MODULES)} layers")
    a, b = ab["A"], ab["B"]
    in_f, out_f, _ = shapes[(layer, module)]
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != in_f or b.shape[0] != out_f or a.shape[0] != b.shape[1]:
        raise LoRAError(f"{where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit the base "
                        f"linear ({in_f} in, {out_f} out)")
    if a.shape[0] > max_lora_rank:
        raise LoRAError(f"{where}: rank {a.shape[0]} is over max_lora_rank {max_lora_rank}")
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        raise LoRAError(f"{where}: non-finite weights")
    return a.float(), b.float()


def _scale(config: dict, rank: int) -> float:
    """peft's scaling for a module of this rank (rank_pattern gives modules their own rank)."""
    alpha = float(config["lora_alpha"])
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
