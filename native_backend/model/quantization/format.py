"""The AutoAWQ "GEMM" checkpoint format, as AutoAWQ writes it and vLLM / transformers read it.

For a linear layer y = x W with W (in, out) (the transpose of torch's (out, in) weight):

    qweight  int32 (in, out / 8)          8 four-bit weights per int32
    qzeros   int32 (in / group, out / 8)  8 four-bit zero points per int32
    scales   fp16  (in / group, out)
    W[i, o] = (q[i, o] - z[i // group, o]) * s[i // group, o]

Within each int32, nibble n (bits 4n .. 4n+3) holds column AWQ_ORDER[n] of its run of 8 columns:

    nibble:   0  1  2  3  4  5  6  7
    column:   0  2  4  6  1  3  5  7

(the order AutoAWQ's GEMM kernel unpacks in). Config: {"quant_method": "awq", "bits": 4,
"group_size": G, "zero_point": true, "version": "gemm"}.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported by the packing functions alone: the gateway's settings check
    import torch  # reads QuantConfig (parallel.validate) in a process that never imports torch

PACK = 8  # four-bit values per int32
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # column held by nibble n
# column c sits in nibble AWQ_NIBBLE_OF_COLUMN[c]
AWQ_NIBBLE_OF_COLUMN = tuple(AWQ_ORDER.index(c) for c in range(PACK))


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """(rows, cols) integers in [0, 15] -> (rows, cols / 8) int32 in AWQ's nibble order."""
    import torch

    rows, cols = values.shape
    if cols % PACK:
        raise ValueError(f"pack_int4: {cols} columns is not a multiple of {PACK}")
    if values.numel() and not (0 <= int(values.min()) and int(values.max()) <= 15):
        raise ValueError("pack_int4: values must lie in [0, 15]")
    # Byte b of a little-endian int32 holds nibbles 2b (low) and 2b + 1 (high): the columns
    # AWQ_ORDER[2b] and AWQ_ORDER[2b + 1]. Built as bytes and viewed as int32 (no 64-bit pass).
    v = values.to(torch.uint8).reshape(rows, cols // PACK, PACK)
    low, high = v[:, :, list(AWQ_ORDER[0::2])], v[:, :, list(AWQ_ORDER[1::2])]
    packed = (low | (high << 4)).contiguous()  # (rows, cols / 8, 4) bytes
    if sys.byteorder != "little":
        packed = packed.flip(-1)
    return packed.view(torch.int32).reshape(rows, cols // PACK)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """(rows, cols / 8) int32 in AWQ's nibble order -> (rows, cols) int32 values in [0, 15]."""
    import torch

    shifts = torch.tensor([4 * n for n in AWQ_NIBBLE_OF_COLUMN], dtype=torch.int32, device=packed.device)
    values = (packed.unsqueeze(-1) >> shifts) & 0xF  # arithmetic shift, then the low nibble: sign-safe
    return values.reshape(packed.shape[0], -1)


@dataclass(frozen=True)
class QuantConfig:
    """A checkpoint's `quantization_config`, checked: what the int4 method can run."""

    group_size: int
    bits: int = 4
    zero_point: bool = True
    version: str = "gemm"
    quant_method: str = "awq"

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> QuantConfig:
        """Refuses, naming the field, anything but AWQ int4 GEMM with zero points."""
        method = str(d.get("quant_method", "")).lower()
        if method != "awq":
            raise ValueError(f"quantization_config.quant_method: {method!r} is not supported (awq is)")
        bits = d.get("bits", d.get("w_bit"))
        group = d.get("group_size", d.get("q_group_size"))
        version = str(d.get("version", "gemm")).lower()
        if bits != 4:
            raise ValueError(f"quantization_config.bits: {bits} is not supported (4 is)")
        if not isinstance(group, int) or group <= 0 or group % PACK:
            raise ValueError(f"quantization_config.group_size: {group!r} (a positive multiple of {PACK} expected)")
        if version != "gemm":
            raise ValueError(f"quantization_config.version: {version!r} is not supported (gemm is)")
        if d.get("zero_point", True) is not True:
            raise ValueError("quantization_config.zero_point: false is not supported (AWQ GEMM has zero points)")
        if d.get("modules_to_not_convert"):
            raise ValueError(f"quantization_config.modules_to_not_convert: {d['modules_to_not_convert']} "
                             "is not supported (every decoder linear must be int4)")
        return cls(group_size=group)

    def to_hf_dict(self) -> dict[str, Any]:
        return {"quant_method": self.quant_method, "bits": self.bits, "group_size": self.group_size,
                "zero_point": self.zero_point, "version": self.version, "modules_to_not_convert": None}


def read_quant_config(hf_config: dict[str, Any]) -> QuantConfig | None:
    """The QuantConfig of a config.json's dict, None for a float checkpoint."""
    qc = hf_config.get("quantization_config")
    return None if qc is None else QuantConfig.from_hf_dict(qc)


def read_quant_config_file(model_dir: str) -> QuantConfig | None:
    """The QuantConfig of an HF directory's config.json, None for a float checkpoint."""
    with open(os.path.join(model_dir, "config.json")) as f:
        return read_quant_config(json.load(f))


def valid_group_sizes(in_features: int, candidates=(32, 64, 128, 256)) -> list[int]:
    """The usual group sizes that divide a layer's input width."""
    return [g for g in candidates if in_features % g == 0]
