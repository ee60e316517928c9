"""GGUF's own 4-bit formats (Q4_0, Q4_1) run by the int4 method as they are stored: each block is
repacked at load into the int4 layout, never dequantized to float.

A GGUF weight is (out, in) row-major, each row cut into blocks of 32 inputs:

    Q4_0 (18 bytes):  fp16 d, 16 bytes of nibbles           w = d * (q - 8)
    Q4_1 (20 bytes):  fp16 d, fp16 m, 16 bytes of nibbles   w = d * q + m
    nibbles: element j in the low nibble of byte j, element j + 16 in its high nibble

The int4 method's offset variant (method.Int4OffsetMethod) holds the same numbers as

    qweight int32 (in, out/8)   the codes q, transposed, 8 per word in AWQ's nibble order
    scales  fp16  (in/32, out)  d
    offsets fp16  (in/32, out)  m (Q4_1), -8 d (Q4_0: exact in fp16, a power-of-two multiple)

so W[i, o] = q * s + off is the block's own formula: the codes, scales and minimums are copied bit
for bit; only the order of the bytes changes (4.5 or 5 bits a weight stay 4.5 or 5 bits a weight).
"""

from __future__ import annotations

import torch

from native_backend.model.layers.rotary import unpermute_rotary_rows
from native_backend.model.quantization.format import QuantConfig, pack_int4

GROUP = 32  # GGUF's block of inputs
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20}
# The decoder linears the int4 method takes, by GGUF name (blk.N.<kind>.weight).
LINEAR_KINDS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def q4_source(reader) -> str | None:
    """"Q4_1", "Q4_0" or "Q4_0+Q4_1" when every decoder linear weight of the GGUF is stored so,
    else None (a file mixing other types, Q4_K_M and the like, is dequantized as before)."""
    types = set()
    for t in reader.tensors:
        parts = t.name.split(".")
        if parts[0] == "blk" and len(parts) == 4 and parts[2] in LINEAR_KINDS and parts[3] == "weight":
            types.add(t.tensor_type.name)
    if not types or not types <= set(BLOCK_BYTES):
        return None
    return "+".join(sorted(types))


def repack(data, qtype: str, out_features: int, in_features: int) -> dict[str, torch.Tensor]:
    """One GGUF Q4_0 / Q4_1 weight's raw blocks -> {"qweight", "scales", "offsets"} (in, out) wise.
    Rows stay in the file's order (the caller permutes rows of q/k as it does for float weights:
    `rows(...)` below gives the (out, ...) views it can permute first)."""
    codes, d, off = rows(data, qtype, out_features, in_features)
    return to_int4_layout(codes, d, off)


def rows(data, qtype: str, out_features: int, in_features: int):
    """(codes (out, in) uint8, d (out, in/32) fp16, offsets (out, in/32) fp16) of the raw blocks."""
    import numpy as np

    size = BLOCK_BYTES.get(qtype)
    if size is None:
        raise ValueError(f"GGUF tensor type {qtype} is not Q4_0 or Q4_1")
    if in_features % GROUP:
        raise ValueError(f"a GGUF {qtype} row of {in_features} inputs is not whole blocks of {GROUP}")
    raw = torch.from_numpy(np.array(data, dtype=np.uint8)).reshape(-1)  # a copy: the file is mapped read-only
    blocks_per_row = in_features // GROUP
    if raw.numel() != out_features * blocks_per_row * size:
        raise ValueError(f"GGUF {qtype} data of {raw.numel()} bytes for a ({out_features}, {in_features}) weight")
    blocks = raw.view(out_features, blocks_per_row, size)
    d = blocks[:, :, 0:2].contiguous().view(torch.float16).reshape(out_features, blocks_per_row)
    if qtype == "Q4_1":
        off, qs = blocks[:, :, 2:4].contiguous().view(torch.float16).reshape(out_features, blocks_per_row), blocks[:, :, 4:]
    else:
        off, qs = (d.float() * -8).half(), blocks[:, :, 2:]  # exact: d times a power of two
    codes = torch.cat((qs & 0x0F, qs >> 4), dim=2).reshape(out_features, in_features)  # (out, in)
    return codes, d, off


def to_int4_layout(codes: torch.Tensor, d: torch.Tensor, off: torch.Tensor) -> dict[str, torch.Tensor]:
    """(out, in) codes and (out, in/32) d and offsets -> the int4 method's (in, ...) tensors."""
    return {"qweight": pack_int4(codes.t()), "scales": d.t().contiguous(), "offsets": off.t().contiguous()}


def dequantize(codes: torch.Tensor, d: torch.Tensor, off: torch.Tensor) -> torch.Tensor:
    """(out, in) float32 of `rows(...)`: the blocks' own formula (what the tests hold gguf against)."""
    out, k = codes.shape
    w = codes.float().view(out, k // GROUP, GROUP) * d.float().unsqueeze(2) + off.float().unsqueeze(2)
    return w.view(out, k)


def quant_config(reader, path: str) -> QuantConfig:
    """The int4 method's config for a GGUF whose decoder linears are all Q4_0 / Q4_1; for any other
    file an error at start that names what it holds."""
    source = q4_source(reader)
    if source is None:
        kinds = sorted({t.tensor_type.name for t in reader.tensors
                        if t.name.split(".")[-2:-1] and t.name.split(".")[-2] in LINEAR_KINDS})
        raise ValueError(f"{path}: quantization gguf runs decoder linears stored as Q4_0 or Q4_1; this file "
                         f"stores them as {', '.join(kinds) or 'nothing'} (use quantization none: dequantized)")
    return QuantConfig(group_size=GROUP, quant_method=f"gguf {source}")


def packed_tensors(name: str, tensor, rotary_heads: int | None):
    """(HF name, tensor) of one GGUF Q4 linear: `name` ("...proj.weight") as .qweight, .scales and
    .offsets, q/k rows back in Hugging Face's order (permuted as blocks: a row is whole blocks)."""
    in_features, out_features = (int(n) for n in tensor.shape[:2])  # GGUF lists dimensions inner first
    codes, d, off = rows(tensor.data, tensor.tensor_type.name, out_features, in_features)
    if rotary_heads is not None:
        codes, d, off = (unpermute_rotary_rows(t, rotary_heads) for t in (codes, d, off))
    base = name.removesuffix(".weight")
    for suffix, packed in to_int4_layout(codes, d, off).items():
        yield f"{base}.{suffix}", packed
