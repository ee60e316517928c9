"""gateway.fastjson: orjson's speed with the standard library's meaning for every input."""

import json

import pytest

from gateway import fastjson


@pytest.mark.parametrize("value", [
    {"id": "cmpl-1", "choices": [{"index": 0, "text": " word", "logprobs": None, "finish_reason": None}]},
    {"text": "é 😀 \u202e nul\x00", "f": 1e-7, "big": 2**63 - 1, "neg": -1.5},
    {"lone": "a\ud800b"},  # orjson cannot encode it: the standard library's ASCII escape instead
    {"huge": 2**70},  # over 64 bits: the same
])
def test_what_it_writes_reads_back_the_same_with_the_standard_library(value):
    assert json.loads(fastjson.dumps(value)) == value


def test_output_is_compact_utf8():
    assert fastjson.dumps({"a": [1, "é"]}) == '{"a":[1,"é"]}'.encode()


@pytest.mark.parametrize("raw", [b'{"t": "\\ud800"}', '{"a": 1}'.encode("utf-16"), b'{"n": 1}'])
def test_it_reads_what_the_standard_library_reads(raw):
    assert fastjson.loads(raw) == json.loads(raw)


def test_bad_json_is_a_value_error():
    with pytest.raises(ValueError):
        fastjson.loads(b"{nope")
