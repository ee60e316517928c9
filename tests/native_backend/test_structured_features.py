"""Constrained decoding with the engine's other features, on the real SmolLM2 (issue 28 item 3).

Each engine serves a batch of a JSON-schema row, a regex row and a plain row, sampled with seeds; every constrained output must be complete and satisfy its constraint (checked with
`jsonschema` and Python's `re`, not by llguidance, which enforced it):

- an FP8 (e4m3) KV cache, with a separate draft model speculating (the target's first 4 layers):
  constrained rows never speculate (their drafts would need a mask per draft position), the plain
  row does, in the same steps;
- AWQ int4 weights (`kvgate quantize`, RTN g64) with an INT8 KV cache;
- tensor parallelism at TP 3 (SmolLM2 has 3 KV heads, so TP 2 is refused): rank 0 fills and
  applies the masks and samples; the workers only run the model.

n-gram speculation, chunked prefill, prefix caching and preemption with recompute are covered in
test_structured_engine.py; the mask's two paths (CPU, Triton) in test_token_mask.py.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from native_backend.config.engine import EngineConfig
from native_backend.core.interface import EngineRequest
from native_backend.core.sampling_params import SamplingParams
from native_backend.model.loader import default_gguf_path
from native_backend.process.factory import make_engine_core
from native_backend.text.grammar_spec import GrammarSpec
from native_backend.tools.quantize import QuantizeOptions, quantize_model

pytestmark = pytest.mark.timeout(900)

# Bounded so that every answer ends well within MAX_TOKENS (a string of <= 12 characters, three digits).
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                         "founded": {"type": "integer", "minimum": 0, "maximum": 999},
                                         "coastal": {"type": "boolean"}},
        "required": ["city", "founded", "coastal"], "additionalProperties": False}
CODE = r"[A-Z]{2}-[0-9]{3}"
MAX_TOKENS = 32
REPEATING = "one two three four five six seven eight nine ten. " * 4  # a draft model guesses it


@pytest.fixture(scope="module")
def make_engine(tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("tok"))

    def make(path=None, **settings):
        settings = dict(num_threads=2, max_num_seqs=8, max_num_batched_tokens=64, kv_cache_bytes=32 << 20) | settings
        return make_engine_core(EngineConfig.build(path=path or default_gguf_path(), tokenizer_cache_dir=cache,
                                                   **settings))

    return make


def batch(engine, tag: str) -> list[EngineRequest]:
    def chat(text):
        return engine.tokenizer.apply_chat_template([{"role": "user", "content": text}])

    city = GrammarSpec("json_schema", json.dumps(CITY))
    seeded = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=s) for s in (1, 2)]
    return [
        EngineRequest(f"{tag}-json", chat("Describe a coastal city as JSON."), seeded[0], grammar=city),
        EngineRequest(f"{tag}-code", chat("A product code, please."), seeded[1], grammar=GrammarSpec("regex", CODE)),
        EngineRequest(f"{tag}-plain", engine.tokenizer.encode(REPEATING),
                      SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)),
    ]


def run_valid(engine, tag: str) -> dict:
    """Runs the batch; asserts every constrained output complete and valid; request -> text."""
    texts, reasons = {}, {}
    for request in batch(engine, tag):
        engine.add_request(request)
        texts[request.request_id] = ""
    while engine.has_unfinished():
        for out in engine.step():
            assert out.error is None, out.error
            texts[out.request_id] += out.new_text
            if out.finished:
                reasons[out.request_id] = out.finish_reason
    for rid in (f"{tag}-json", f"{tag}-code"):
        assert reasons[rid] == "stop", (rid, reasons[rid], texts[rid])
    jsonschema.validate(json.loads(texts[f"{tag}-json"]), CITY)
    assert re.fullmatch(CODE, texts[f"{tag}-code"]), texts[f"{tag}-code"]
    assert reasons[f"{tag}-plain"] == "length"
    return texts


def test_fp8_kv_cache_with_a_draft_model_speculating_beside_constrained_rows(make_engine):
    engine = make_engine(kv_cache_dtype="fp8_e4m3",
                         speculative=dict(method="draft", draft_num_layers=4, num_speculative_tokens=3,
                                          max_batch_size=None))
    assert "fp8_e4m3" in engine.describe()
    run_valid(engine, "fp8")
    stats = engine.stats()
    assert stats.spec_decode_num_drafts > 0  # the plain row speculated; the constrained ones could not


def test_awq_int4_weights_with_an_int8_kv_cache(make_engine, tmp_path):
    quantize_model(default_gguf_path(), str(tmp_path), QuantizeOptions(method="rtn", group_size=64))
    engine = make_engine(str(tmp_path), kv_cache_dtype="int8")
    line = engine.describe()
    assert "int4 AWQ g64" in line and "int8" in line
    run_valid(engine, "awq")


def test_tensor_parallel_rank_0_masks_and_samples(make_engine):
    threads = torch.get_num_threads()
    engine = make_engine(tensor_parallel_size=3, num_threads=1)
    try:
        assert "3 tensor-parallel ranks" in engine.describe()
        run_valid(engine, "tp3")
    finally:
        engine.core.executor.close()
        torch.set_num_threads(threads)
