"""`kvgate quantize`, contributed by the native plugin through the `register_commands` hook: a
float HF directory in, an AWQ GEMM checkpoint out that a native deployment accepts; bad input as
a message and a nonzero exit."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from gateway import cli
from kvgate_native.backend import NativeBackend
from kvgate_native.settings import NativeSettings
from native_backend.model.loader import load_hf_model
from native_backend.model.quantization import calibration
from native_backend.model.quantization.method import AWQLinearMethod
from tests.support.data.llama_checkpoints import VOCAB, make_checkpoint


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("float")
    make_checkpoint(path, tie=True, rope_scaling=None)
    return path


def quantize(capsys, *args) -> tuple[int, str]:
    code = cli.main(["quantize", *map(str, args)])
    return code, capsys.readouterr().err


def test_rtn_writes_a_checkpoint_the_engine_loads_as_int4(float_dir, tmp_path, capsys):
    code, err = quantize(capsys, float_dir, "--method", "rtn", "--group-size", "16", "--out", tmp_path)
    assert code == 0, err
    assert "int4 pack" in err and "14/14" in err and f"wrote {tmp_path}" in err
    assert json.load(open(tmp_path / "config.json"))["quantization_config"]["group_size"] == 16
    model = load_hf_model(str(tmp_path))
    assert isinstance(model.model.layers[0].mlp.down_proj.method, AWQLinearMethod)


def test_awq_searches_on_the_calibration_text(float_dir, tmp_path, capsys, monkeypatch):
    """The tiny model has no tokenizer: its calibration tokens are drawn at random instead."""
    def tokens(source, samples, seq_len):
        assert (samples, seq_len) == (3, 24)
        return torch.randint(0, VOCAB, (samples, seq_len), generator=torch.Generator().manual_seed(0))

    monkeypatch.setattr(calibration, "calibration_batch", tokens)
    code, err = quantize(capsys, float_dir, "--method", "awq", "--group-size", "16", "--calib-samples", "3",
                         "--calib-seq-len", "24", "--out", tmp_path)
    assert code == 0, err
    assert "awq search" in err and "2/2" in err
    assert load_hf_model(str(tmp_path)).config.tie_word_embeddings


@pytest.mark.parametrize("args, message", [
    (["--group-size", "32"], "model.layers.0.mlp.down_proj: group size 32 does not divide its input width 112"),
    (["--bits", "3"], "bits: 3 is not supported"),
])
def test_bad_input_is_a_message_and_exit_1(float_dir, tmp_path, capsys, args, message):
    code, err = quantize(capsys, float_dir, "--method", "rtn", "--out", tmp_path, *args)
    assert code == 1 and f"kvgate quantize: {message}" in err


def test_native_settings_accept_awq_and_gguf_and_refuse_the_rest_with_the_reason():
    assert NativeSettings(quantization="awq").quantization == "awq"
    assert NativeSettings(quantization="gguf").engine_config().model.quantization == "gguf"  # the default GGUF
    with pytest.raises(ValueError, match="quantization: 'gptq' is not supported by this engine: it runs float, "
                                         "AWQ int4 .* and GGUF Q4_0 / Q4_1"):
        NativeSettings(quantization="gptq")
    with pytest.raises(ValueError, match="quantization: gguf needs a .gguf model file"):
        NativeSettings(model="/models/awq-dir", quantization="gguf")


def test_awq_setting_with_a_float_checkpoint_fails_at_start(float_dir):
    backend = NativeBackend(NativeSettings(model=str(float_dir), quantization="awq"), name="q")
    with pytest.raises(RuntimeError, match="quantization awq, but .* is not an AWQ checkpoint"):
        asyncio.run(backend.start())
