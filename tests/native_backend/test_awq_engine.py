"""The default model (SmolLM2-135M) quantized to int4 (RTN, group 64) and served by the whole
engine: the start-up line says the format and the bytes; the C kernel's greedy tokens equal the
torch reference's token for token; the text stays close to the float model's."""

from __future__ import annotations

import pydoc_data.topics
import pytest

from native_backend.engine import LLMEngine
from native_backend.engine_config import EngineConfig
from native_backend.loader import default_gguf_path
from native_backend import cpu_kernels
from native_backend.protocol import EngineRequest
from native_backend.quantization.quantize import QuantizeOptions, quantize_model
from native_backend.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(900)
NEW_TOKENS = 16
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def int4_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("smollm2-rtn")
    quantize_model(default_gguf_path(), str(out), QuantizeOptions(method="rtn", group_size=64))
    return str(out)


@pytest.fixture(scope="module")
def make_engine(tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("tok"))

    def make(path: str, cpu_kernels: bool = True) -> LLMEngine:
        return LLMEngine(EngineConfig.build(path=path, tokenizer_cache_dir=cache, num_threads=2,
                                            cpu_kernels=cpu_kernels, kv_cache_bytes=64 << 20))
    return make


def run(engine: LLMEngine, prompts) -> list[list[int]]:
    for i, p in enumerate(prompts):
        engine.add_request(EngineRequest(f"r{i}", p, GREEDY))
    out = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for o in engine.step():
            assert o.error is None
            out[o.request_id].extend(o.new_token_ids)
    return [out[f"r{i}"] for i in range(len(prompts))]


def test_int4_engine_greedy_equals_the_torch_reference_and_stays_near_fp32(int4_dir, make_engine):
    kernel = make_engine(int4_dir)
    line = kernel.describe()
    assert "linears int4 AWQ g64" in line and "210 linears" in line and "weights" in line
    assert ("one-call decode steps" in line) == cpu_kernels.int4_available()
    assert kernel.stats().weights == "int4 AWQ g64"  # what /v1/models says
    text = " ".join(list(pydoc_data.topics.topics.values())[70:80])
    ids = kernel.tokenizer.encode(text)
    prompts = [ids[i * 100: i * 100 + 40 + 9 * i] for i in range(3)]
    int4 = run(kernel, prompts)
    if cpu_kernels.int4_available():
        reference = make_engine(int4_dir, cpu_kernels=False)
        assert "torch reference" in reference.describe()
        assert run(reference, prompts) == int4
    fp32_engine = make_engine(default_gguf_path())
    assert fp32_engine.stats().weights == "float32"
    fp32 = run(fp32_engine, prompts)
    first_divergence = [next((j for j, (a, b) in enumerate(zip(x, y)) if a != b), NEW_TOKENS) for x, y in zip(int4, fp32)]
    assert sum(first_divergence) >= 2 * len(prompts), first_divergence  # int4 is close, not identical
