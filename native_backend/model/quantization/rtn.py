"""Round-to-nearest int4 with a zero point per group: the quantizer RTN is and AWQ ends with.

Per group of `group` consecutive input weights of one output row (AutoAWQ's pseudo_quantize):

    s = (max - min) / 15          (stored as fp16; q is computed with the stored s; a constant
                                   group's range is stretched to include 0)
    z = clamp(-round(min / s), 0, 15)
    q = clamp(round(w / s) + z, 0, 15)          w ~ (q - z) * s
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from native_backend.model.quantization.format import PACK, pack_int4, valid_group_sizes

MAX_Q = 15


@dataclass
class Int4Weight:
    """One layer's weight in the AutoAWQ GEMM tensors (see format.py)."""

    qweight: torch.Tensor  # int32 (in, out/8)
    qzeros: torch.Tensor  # int32 (in/g, out/8)
    scales: torch.Tensor  # fp16 (in/g, out)


def check_group_size(name: str, weight_shape: tuple[int, int], group: int) -> None:
    """A group must divide the layer's input width and the output must pack by 8; the error names
    the layer and the group sizes that would work."""
    out_features, in_features = weight_shape
    if in_features % group:
        raise ValueError(f"{name}: group size {group} does not divide its input width {in_features}; "
                         f"group sizes that do: {valid_group_sizes(in_features) or 'none of 32, 64, 128, 256'}")
    if out_features % PACK:
        raise ValueError(f"{name}: {out_features} output features is not a multiple of {PACK} (int4 packing)")


def group_steps(hi: torch.Tensor, lo: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each group's max and min -> its step s (float32 holding the stored fp16 value) and zero
    point z (float, 0..15)."""
    # A constant group has no range to spread 16 codes over: stretch it to include 0, so the
    # constant becomes code 15 (or 0) of a real step instead of clamping away.
    flat = hi - lo < 1e-5
    hi, lo = torch.where(flat, hi.clamp(min=0), hi), torch.where(flat, lo.clamp(max=0), lo)
    s = ((hi - lo).clamp(min=1e-5) / MAX_Q).to(torch.float16)
    if not torch.isfinite(s).all():
        raise ValueError("a group's range does not fit an fp16 scale")
    s32 = s.float().clamp(min=torch.finfo(torch.float16).tiny)  # a scale that underflowed to 0
    return s32, (-torch.round(lo / s32)).clamp(0, MAX_Q)


def quantize_groups(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w (out, in) float -> q (out, in) int64, z (out, in/g) int64, s (out, in/g) fp16."""
    out_features, in_features = w.shape
    wg = w.float().reshape(out_features, in_features // group, group)
    s, z = group_steps(wg.amax(dim=-1), wg.amin(dim=-1))
    q = (torch.round(wg / s[..., None]) + z[..., None]).clamp(0, MAX_Q)
    return q.reshape(out_features, in_features).long(), z.long(), s.to(torch.float16)


def fake_quantize_groups(wg: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """wg (..., g) float32, with its groups' max and min (...), becomes what its int4 form
    dequantizes to, in place: quantize_groups' codes without the int64 round trips or a tensor
    more (the searches call this hundreds of times a layer; the clip search knows max and min
    without a pass over wg). Returns wg."""
    s, z = group_steps(hi, lo)
    s, z = s[..., None], z[..., None]
    # round(w / s) + z clamped to 0..15, minus z again, is round(w / s) clamped to -z..15 - z
    return wg.div_(s).round_().clamp_(-z, MAX_Q - z).mul_(s)


def fake_quantize_(w: torch.Tensor, group: int) -> torch.Tensor:
    """w (out, in) float32 becomes what its int4 form dequantizes to, in place."""
    wg = w.view(w.shape[0], -1, group)
    lo, hi = torch.aminmax(wg, dim=-1)
    fake_quantize_groups(wg, hi, lo)
    return w


def fake_quantize(w: torch.Tensor, group: int) -> torch.Tensor:
    """w (out, in) -> what its int4 form dequantizes to, same shape, float32 (for the searches)."""
    return fake_quantize_(w.to(torch.float32, copy=True), group)


def quantize_weight(w: torch.Tensor, group: int) -> Int4Weight:
    """w (out, in) float -> the packed checkpoint tensors."""
    q, z, s = quantize_groups(w, group)
    return Int4Weight(qweight=pack_int4(q.t()), qzeros=pack_int4(z.t()), scales=s.t().contiguous())
