"""The AutoAWQ GEMM format: packing against an unpacker written from the format's rules alone,
the checkpoint config's checks, and round-to-nearest's arithmetic."""

from __future__ import annotations

import pytest
import torch

from native_backend.model.quantization import rtn
from native_backend.model.quantization.format import QuantConfig, pack_int4, unpack_int4
from native_backend.model.quantization.reference import dequantize
from tests.support.data.awq_rules import rules_unpack


def test_a_known_word():
    # columns 0..7 hold 1..8: nibbles in AWQ order hold columns 0,2,4,6,1,3,5,7 = 1,3,5,7,2,4,6,8
    packed = pack_int4(torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]]))
    assert packed.dtype == torch.int32 and packed.shape == (1, 1)
    assert int(packed) & 0xFFFFFFFF == 0x86427531


@pytest.mark.parametrize("shape", [(1, 8), (5, 16), (64, 192)])
def test_packing_matches_the_rules_and_round_trips(shape):
    values = torch.randint(0, 16, shape, generator=torch.Generator().manual_seed(shape[1]))
    values[0, :8] = 15  # bit 31 set: a negative int32
    packed = pack_int4(values)
    assert packed.shape == (shape[0], shape[1] // 8)
    assert rules_unpack(packed) == values.tolist()
    assert torch.equal(unpack_int4(packed), values.to(torch.int32))


def test_pack_refuses_values_outside_a_nibble_and_ragged_columns():
    with pytest.raises(ValueError, match=r"\[0, 15\]"):
        pack_int4(torch.tensor([[16] * 8]))
    with pytest.raises(ValueError, match="multiple of 8"):
        pack_int4(torch.zeros(2, 12, dtype=torch.long))


def test_quant_config_accepts_awq_gemm_and_refuses_the_rest_naming_the_field():
    qc = QuantConfig.from_hf_dict({"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True,
                                   "version": "GEMM", "modules_to_not_convert": None})
    assert qc.group_size == 64 and QuantConfig.from_hf_dict(qc.to_hf_dict()) == qc
    bad = {"bits": (8, "bits"), "version": ("gemv", "version"), "quant_method": ("gptq", "quant_method"),
           "zero_point": (False, "zero_point"), "group_size": (60, "group_size"),
           "modules_to_not_convert": (["lm_head", "model.layers.0.mlp"], "modules_to_not_convert")}
    for key, (value, field) in bad.items():
        d = {**qc.to_hf_dict(), key: value}
        with pytest.raises(ValueError, match=f"quantization_config.{field}"):
            QuantConfig.from_hf_dict(d)


def test_rtn_dequantizes_within_half_a_step_and_hits_each_groups_extremes():
    w = torch.randn(24, 128, generator=torch.Generator().manual_seed(3))
    q = rtn.quantize_weight(w, 32)
    assert q.qweight.shape == (128, 3) and q.qzeros.shape == (4, 3) and q.scales.shape == (4, 24)
    assert q.scales.dtype == torch.float16
    back = dequantize(q.qweight, q.qzeros, q.scales).t()  # (out, in)
    step = q.scales.float().t().repeat_interleave(32, dim=1)
    assert ((back - w).abs() <= step / 2 + 1e-6).all()
    assert torch.equal(rtn.fake_quantize(w, 32), back)
    # the codes span 0..15 in every group: the grid is stretched over [min, max]
    codes = unpack_int4(q.qweight).t().reshape(24, 4, 32)
    assert (codes.amin(-1) == 0).all() and (codes.amax(-1) == 15).all()


def test_rtn_keeps_a_constant_group_up_to_the_fp16_scale():
    w = torch.full((8, 32), 0.25)
    w[1], w[2], w[3] = -3.0, 0.0, 1e-7
    back = dequantize(*vars(rtn.quantize_weight(w, 32)).values()).t()
    torch.testing.assert_close(back, w, atol=1e-6, rtol=1e-3)


def test_a_group_size_that_does_not_divide_names_the_layer_and_the_sizes_that_do():
    with pytest.raises(ValueError, match=r"model.layers.3.mlp.up_proj: group size 128 does not divide its input "
                                         r"width 576; group sizes that do: \[32, 64\]"):
        rtn.check_group_size("model.layers.3.mlp.up_proj", (1536, 576), 128)
