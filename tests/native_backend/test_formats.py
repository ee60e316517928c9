"""One list per format (config/formats.py): the KV cache stores each KV format in a torch dtype of
its size, and the Helm chart's values schema offers exactly the engine's dtypes and KV dtypes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from native_backend.config.engine import SPECULATIVE_METHODS
from native_backend.config.formats import DTYPES, KV_ALIASES, KV_CACHE_DTYPES, KV_FORMATS, kv_format
from native_backend.model.kv_cache import KV_CACHE_DTYPES as STORED

SCHEMA = Path(__file__).resolve().parents[2] / "charts" / "kvgate" / "values.schema.json"


@pytest.mark.parametrize("name", list(KV_FORMATS))
def test_each_kv_format_is_stored_in_a_torch_dtype_of_its_size(name):
    fmt, stored = KV_FORMATS[name], STORED[name]
    assert torch.empty((), dtype=stored.storage).element_size() == fmt.bytes_per_element
    assert stored.storage.is_floating_point == (fmt.scaling != "per_token_head")  # int8 alone stores integers
    assert (stored.name, stored.scaling, stored.code) == (fmt.name, fmt.scaling, fmt.code)


def test_aliases_name_formats_and_unknown_names_list_the_choices():
    assert {kv_format(alias).name for alias in KV_ALIASES} <= set(KV_FORMATS)
    with pytest.raises(ValueError, match="unknown KV cache dtype 'fp4'; expected one of .*int8"):
        kv_format("fp4")


def _enums(schema: dict, key: str) -> list[list[str]]:
    found = []
    if isinstance(schema, dict):
        for name, value in schema.items():
            if name == key and isinstance(value, dict) and "enum" in value:
                found.append(value["enum"])
            found += _enums(value, key)
    elif isinstance(schema, list):
        for value in schema:
            found += _enums(value, key)
    return found


@pytest.mark.parametrize("key, engine_list", [("kvCacheDtype", KV_CACHE_DTYPES), ("dtype", DTYPES),
                                               ("method", SPECULATIVE_METHODS)])
def test_the_helm_schema_offers_the_engines_lists(key, engine_list):
    enums = _enums(json.loads(SCHEMA.read_text()), key)
    assert enums and all(enum == list(engine_list) for enum in enums), enums
