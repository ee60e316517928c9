""""What is the capital of France?" through the chat template, answered right in every KV dtype
and every weight format we ship: float32 weights, the GGUF's int4 linears run as stored
(`quantization: gguf`, configs/default.yaml) and an AWQ int4 checkpoint (`kvgate quantize`'s
format; round-to-nearest here, for speed), each with a float32, bfloat16, fp8_e4m3, fp8_e5m2 and
int8 cache. The question is a near tie in the model ("The" 0.152 against "L" 0.140 with a float32
cache), so KV error flips it: before the fp8 keys were stored centered (kv_scales.calibrate), an
fp8_e5m2 cache over float32 weights answered "L'Étoile de la Ferre, ...".

One model load per weight format (the engine's executor builds it), then a fresh cache per KV
dtype with the engine's calibration, through the engine's model runner
(support/checks/kv_answers.py); 12 new tokens."""

from __future__ import annotations

import pytest

from native_backend.config.cache_dir import tokenizer_cache_dir
from native_backend.config.engine import EngineConfig
from native_backend.execution.executor import InProcessExecutor
from native_backend.model.loader import default_gguf_path
from native_backend.text.tokenizer import Tokenizer
from tests.support.checks.kv_answers import cache_for, greedy_answer

pytestmark = pytest.mark.timeout(900)

KV_DTYPES = ("float32", "bfloat16", "fp8_e4m3", "fp8_e5m2", "int8")
WEIGHTS = ("float32", "gguf-int4", "awq-int4")
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_pretrained(default_gguf_path(), cache_dir=str(tokenizer_cache_dir()))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """weights -> the model as the engine builds it, loaded on first use and kept for the module."""
    loaded = {}

    def model(weights: str):
        if weights not in loaded:
            loaded[weights] = InProcessExecutor(EngineConfig.build(**_settings(weights, tmp_path_factory), num_threads=1),
                                                allocate=False).model
        return loaded[weights]

    return model


def _settings(weights: str, tmp_path_factory) -> dict:
    if weights == "gguf-int4":
        return dict(path=default_gguf_path(), quantization="gguf")
    if weights == "awq-int4":
        from native_backend.tools.quantize import QuantizeOptions, quantize_model

        path = str(tmp_path_factory.mktemp("smollm2-awq-g64"))
        quantize_model(default_gguf_path(), path, QuantizeOptions(method="rtn", group_size=64))
        return dict(path=path)
    return dict(path=default_gguf_path())


@pytest.mark.parametrize("weights", WEIGHTS)
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_the_capital_question_is_answered_right(models, tokenizer, weights, kv_dtype):
    from native_backend.model.quantization.method import weights_format

    model = models(weights)
    assert weights_format(model).startswith("float32" if weights == "float32" else "int4")
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    cache = cache_for(model, kv_dtype, tokenizer, len(prompt) + MAX_TOKENS)
    answer = tokenizer.decode(greedy_answer(model, cache, prompt, MAX_TOKENS, set(tokenizer.eos_token_ids)))
    assert answer.startswith("The capital of France is Paris"), (weights, kv_dtype, answer)
