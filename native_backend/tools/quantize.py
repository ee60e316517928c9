"""A float model in (GGUF file or HF directory), an AutoAWQ GEMM int4 checkpoint out.

    rtn:  every decoder linear rounded to nearest, per group, with a zero point
    awq:  first the activation-aware search on calibration text (awq.py: scales folded into the
          op before each linear group, then clipping), then the same rounding

Both write the same format (checkpoint.py), which our loader, vLLM and transformers read.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from native_backend.model.quantization.checkpoint import (
    check_group_sizes, copy_tokenizer, hf_config_dict, write_checkpoint)
from native_backend.model.quantization.format import QuantConfig, read_quant_config_file

METHODS = ("awq", "rtn")


@dataclass(frozen=True)
class QuantizeOptions:
    method: str = "awq"  # awq | rtn
    bits: int = 4
    group_size: int = 64
    calib_samples: int = 16  # AWQ: calibration sequences ...
    calib_seq_len: int = 256  # ... of this many tokens each


def quantize_model(source: str, out_dir: str, options: QuantizeOptions,
                   progress: Callable[[str, int, int], None] = lambda *_: None) -> None:
    """`progress(stage, done, total)` after each unit of work (a layer searched, a linear packed)."""
    if options.method not in METHODS:
        raise ValueError(f"method: {options.method!r} (one of {', '.join(METHODS)})")
    if options.bits != 4:
        raise ValueError(f"bits: {options.bits} is not supported (4 is)")
    quant = QuantConfig.from_hf_dict({"quant_method": "awq", "bits": 4, "group_size": options.group_size})
    model = load_float_model(source)
    check_group_sizes(model, options.group_size)
    if options.method == "awq":
        from native_backend.model.quantization.awq import awq_search
        from native_backend.model.quantization.calibration import calibration_batch

        tokens = calibration_batch(source, options.calib_samples, options.calib_seq_len)
        awq_search(model, tokens, options.group_size, lambda i, n: progress("awq search", i, n))
    num = len(model.model.layers) * 7
    done = iter(range(1, num + 1))
    write_checkpoint(model, quant, out_dir, hf_config_dict(source, model.config),
                     lambda _name: progress("int4 pack", next(done), num))
    copy_tokenizer(source, out_dir)


def load_float_model(source: str):
    """The source as float32 with dense torch linears (what the searches modify in place)."""
    from native_backend.model.layers.context import LayerContext
    from native_backend.model.loader import load_model

    if not source.endswith(".gguf") and read_quant_config_file(source) is not None:
        raise ValueError(f"{source} is already quantized (config.json has a quantization_config)")
    return load_model(source, LayerContext.for_device("cpu", torch.float32, cpu_kernels=False))
