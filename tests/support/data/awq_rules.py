"""The AutoAWQ GEMM packing read from the format's rules alone, independent of the code under
test (native_backend.model.quantization): for the packing and model tests."""

from __future__ import annotations

import torch

AWQ_COLUMN_OF_NIBBLE = [0, 2, 4, 6, 1, 3, 5, 7]


def rules_unpack(packed: torch.Tensor) -> list[list[int]]:
    """Bits 4n..4n+3 of each int32 (read as unsigned) hold column [0, 2, 4, 6, 1, 3, 5, 7][n] of its
    run of 8 columns."""
    rows = []
    for row in packed.tolist():
        values = [0] * (8 * len(row))
        for j, word in enumerate(row):
            word &= 0xFFFFFFFF
            for n in range(8):
                values[8 * j + AWQ_COLUMN_OF_NIBBLE[n]] = (word >> (4 * n)) & 0xF
        rows.append(values)
    return rows


def rules_dequantize(tensors: dict, prefix: str) -> torch.Tensor:
    """(out, in) float weight of one linear: W^T[i, o] = (q[i, o] - z[i // g, o]) * s[i // g, o]."""
    q = torch.tensor(rules_unpack(tensors[f"{prefix}.qweight"]), dtype=torch.float32)  # (in, out)
    z = torch.tensor(rules_unpack(tensors[f"{prefix}.qzeros"]), dtype=torch.float32)
    s = tensors[f"{prefix}.scales"].float()
    group = q.shape[0] // s.shape[0]
    return ((q - z.repeat_interleave(group, 0)) * s.repeat_interleave(group, 0)).t()
