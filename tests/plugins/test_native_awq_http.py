"""Int4 weights served over HTTP: a live gateway with two native deployments, an AutoAWQ GEMM
directory made by `kvgate quantize` from the default SmolLM2 GGUF and that GGUF run with
quantization gguf (its Q4_1 linears as stored), called with the real openai client. Greedy outputs
equal the engine's own output on the same directory; /v1/models and the start-up line say int4;
the README's question gets a sensible answer from both.

The directory is made with --method rtn: the same checkpoint format, tensors and kernels as
--method awq, whose search (tests/native_backend/test_awq_search.py) takes over an hour for
SmolLM2's 30 layers on the shared 2-core box, even on 128 calibration tokens."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from native_backend.config.engine import EngineConfig
from native_backend.core.interface import EngineRequest
from native_backend.core.sampling_params import SamplingParams
from native_backend.kernels import cpu_kernels
from native_backend.process.factory import make_engine_core
from tests.support.servers.loopback import GatewayServer

pytestmark = pytest.mark.timeout(1800)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "A list comprehension in Python"]
NEW_TOKENS = 20


@pytest.fixture(scope="module")
def awq_dir(tmp_path_factory):
    """`kvgate quantize default --method rtn --group-size 64`: an AutoAWQ GEMM directory."""
    out = str(tmp_path_factory.mktemp("smollm2-int4"))
    subprocess.run([sys.executable, "-m", "gateway.cli", "quantize", "default", "--method", "rtn", "--group-size",
                    "64", "--out", out], check=True, cwd=ROOT, capture_output=True, timeout=1200)
    return out


@pytest.fixture(scope="module")
def gw(awq_dir, tmp_path_factory):
    os.environ.setdefault("KVGATE_CACHE_DIR", str(tmp_path_factory.mktemp("kvgate-cache")))
    config = f"""
models:
  - name: smollm2-awq
    deployments:
      - name: awq-0
        backend: native
        settings: {{model: "{awq_dir}", quantization: awq, max_num_seqs: 4, max_num_batched_tokens: 256,
                    kv_cache_bytes: 67108864, num_threads: 2}}
  - name: smollm2-q4
    deployments:
      - name: q4-0
        backend: native
        settings: {{quantization: gguf, max_num_seqs: 4, max_num_batched_tokens: 256,
                    kv_cache_bytes: 67108864, num_threads: 2}}
"""
    with GatewayServer(config, ready_timeout=900) as server:
        yield server


def engine_greedy(path: str, prompts: list[str], cache_dir: str) -> list[str]:
    """The engine in this process on the same directory: each prompt's greedy text, one at a time."""
    engine = make_engine_core(EngineConfig.build(path=path, tokenizer_cache_dir=cache_dir, num_threads=2,
                                          kv_cache_bytes=64 << 20, max_num_seqs=4, max_num_batched_tokens=256))
    texts = []
    for i, prompt in enumerate(prompts):
        sampling = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
        engine.add_request(EngineRequest(f"r{i}", engine.tokenizer.encode(prompt), sampling))
        tokens, text = [], ""
        while engine.has_unfinished():
            for out in engine.step():
                assert out.error is None
                tokens.extend(out.new_token_ids)
                text += out.new_text
        assert len(tokens) == NEW_TOKENS
        texts.append(text)
    return texts


def test_greedy_completions_over_http_equal_the_engines_own_output(gw, awq_dir, tmp_path):
    client = gw.openai(timeout=300)
    served = []
    for prompt in PROMPTS:
        out = client.completions.create(model="smollm2-awq", prompt=prompt, max_tokens=NEW_TOKENS, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == NEW_TOKENS
        served.append(out.choices[0].text)
    assert served == engine_greedy(awq_dir, PROMPTS, str(tmp_path))
    assert len(set(served)) == len(PROMPTS)


def test_models_and_the_start_up_line_say_int4(gw):
    cards = {m.id: m for m in gw.openai().models.list().data}
    assert cards["smollm2-awq"].model_extra["weights"] == "int4 AWQ g64"
    assert cards["smollm2-q4"].model_extra["weights"] == "int4 GGUF Q4_1 g32"
    awq_line, q4_line = gw.backend("awq-0").client.description, gw.backend("q4-0").client.description
    assert "210 linears int4 AWQ g64 (C kernel)" in awq_line and "one-call decode steps" in awq_line
    assert "210 linears int4 GGUF Q4_1 g32 (C kernel)" in q4_line
    # which CPU kernels run: the path this CPU takes (the engines' processes choose as this one does)
    chosen = cpu_kernels.path()
    assert cards["smollm2-awq"].model_extra["cpu_kernels"] == chosen.name
    assert f"C kernels {cpu_kernels.path_label()}" in awq_line and f"C kernels {cpu_kernels.path_label()}" in q4_line
    # how prompt chunks run: what the start-up line says was chosen (bf16 on AVX512_BF16 / AMX, else fp32)
    for name, line in (("smollm2-awq", awq_line), ("smollm2-q4", q4_line)):
        prefill = cards[name].model_extra["prefill"]
        matmuls, attention = re.fullmatch(r"matmuls (\w+), attention (\w+)", prefill).groups()
        assert f"prefill matmuls {matmuls}" in line and f"prefill attention {attention}" in line


@pytest.mark.parametrize("model", ["smollm2-awq", "smollm2-q4"])
def test_the_readme_question_gets_a_sensible_answer(gw, model):
    out = gw.openai(timeout=300).chat.completions.create(
        model=model, messages=[{"role": "user", "content": "What is the capital of France?"}], temperature=0,
        max_tokens=24)
    assert "Paris" in out.choices[0].message.content, out.choices[0].message.content
