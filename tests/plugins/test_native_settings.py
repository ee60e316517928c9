"""The native plugin's settings against the engine's config: every setting reaches the engine,
field by field, and every engine field is a setting (or named here as the plugin's own)."""

from __future__ import annotations

import dataclasses

import pydantic
import pytest

from kvgate_native.backend import NativeSettings
from native_backend.engine_config import FIELD_PARTS, EngineConfig

# Settings that are the plugin's, not the engine's: how the plugin runs it, or names it takes.
PLUGIN_ONLY = {"model", "startup_timeout_s", "quantization", "supervision"}
# Engine fields the plugin fills itself instead of taking from YAML.
ENGINE_ONLY = {"path", "tokenizer_cache_dir", "cpu_kv_cache_bytes"}


def test_every_setting_is_an_engine_field_and_back():
    settings = set(NativeSettings.model_fields) - PLUGIN_ONLY
    assert settings == set(FIELD_PARTS) - ENGINE_ONLY


def _non_default_settings() -> dict:
    """A value for every engine setting that differs from its default (and is valid)."""
    return dict(dtype="bfloat16", device="cuda:1", num_threads=3, cpu_kernels=False, block_size=32,
                kv_cache_dtype="int8", kv_cache_bytes=123 << 20, memory_fraction=0.5, enable_prefix_caching=False,
                kv_scales="unit", max_num_seqs=7, max_num_batched_tokens=99, max_model_len=777, tensor_parallel_size=1)


def test_each_setting_arrives_in_its_part():
    values = _non_default_settings()
    assert set(values) == set(NativeSettings.model_fields) - PLUGIN_ONLY
    config = NativeSettings(model="/models/x.gguf", **values).engine_config()
    for name, value in values.items():
        assert getattr(getattr(config, FIELD_PARTS[name]), name) == value, name
    assert config.model.path == "/models/x.gguf"


@pytest.mark.parametrize("field, value", [("kv_cache_dtype", "fp4"), ("kv_scales", "guess"), ("block_size", 0)])
def test_bad_values_are_refused_naming_the_field(field, value):
    with pytest.raises(pydantic.ValidationError, match=field):
        NativeSettings(**{field: value})


def test_engine_config_parts_validate_themselves():
    with pytest.raises(ValueError, match="cache.kv_cache_dtype: 'fp4'"):
        EngineConfig.build(path="m.gguf", kv_cache_dtype="fp4")
    with pytest.raises(ValueError, match="scheduler.max_num_seqs must be positive"):
        EngineConfig.build(path="m.gguf", max_num_seqs=0)
    with pytest.raises(TypeError, match="unknown engine setting 'max_seqs'"):
        EngineConfig.build(path="m.gguf", max_seqs=4)
    assert EngineConfig.build(path="m.gguf", dtype="bfloat16").kv_cache_dtype == "bfloat16"
    assert dataclasses.is_dataclass(EngineConfig.build(path="m.gguf").cache)
