"""Tool calls whose markers are special tokens of the model (Mistral v11's [TOOL_CALLS]/[ARGS],
Llama 4's <|python_start|>/<|python_end|>), through the whole native path over HTTP: the openai
client, the gateway, the native backend (its parser's special_markers kept by the engine's
detokenizer, kept_special_tokens), a real engine process, and back. The model is a tiny Llama
that says a scripted call whatever it is asked (tests/support/data/scripted_llama.py), with
SmolLM2's tokenizer plus those markers as special tokens, as those models' tokenizers have them;
transformers checks it says the script. A detokenizer that drops the markers loses the calls: the
client then gets the call's text as content and no tool_calls."""

from __future__ import annotations

import json

import pytest

from native_backend.model.loader import default_gguf_path
from native_backend.text.tokenizer import gguf_tokenizer_dir
from tests.support.data.scripted_llama import make_scripted_checkpoint
from tests.support.servers.loopback import native_gateway

pytestmark = pytest.mark.timeout(600)

MARKERS = ["[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "<|python_start|>", "<|python_end|>"]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
SCRIPTS = {  # model name -> (tool_call_parser, what the model says)
    "mistral-v11": ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}'),
    "llama4-pythonic": ("pythonic", "<|python_start|>[get_weather(city='Oslo')]<|python_end|>"),
}


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    tokenizer_dir = gguf_tokenizer_dir(default_gguf_path(), tmp_path_factory.mktemp("tok"))
    models = []
    for name, (parser, script) in SCRIPTS.items():
        path = str(tmp_path_factory.mktemp(name))
        make_scripted_checkpoint(path, tokenizer_dir, script, after="<|im_start|>assistant\n", special=MARKERS)
        models.append(f"""
  - name: {name}
    deployments:
      - name: {name}
        backend: native
        settings: {{model: {path}, tool_call_parser: {parser}, num_threads: 1, kv_cache_bytes: 16777216}}
""")
    with native_gateway("models:" + "".join(models), tmp_path_factory) as server:
        yield server


@pytest.mark.parametrize("model", SCRIPTS)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_call_written_with_special_token_markers_reaches_the_client_as_a_tool_call(gw, model, stream):
    client = gw.openai(timeout=300)
    kw = dict(model=model, messages=[{"role": "user", "content": "Weather in Oslo?"}], tools=[WEATHER],
              temperature=0, max_tokens=64)
    if stream:
        content, calls, finish = "", {}, None
        for chunk in client.chat.completions.create(stream=True, **kw):
            if not chunk.choices:
                continue
            delta, finish = chunk.choices[0].delta, chunk.choices[0].finish_reason or finish
            content += delta.content or ""
            for call in delta.tool_calls or []:
                got = calls.setdefault(call.index, {"name": "", "arguments": ""})
                got["name"] += call.function.name or ""
                got["arguments"] += call.function.arguments or ""
        found = [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]
    else:
        choice = client.chat.completions.create(**kw).choices[0]
        content, finish = choice.message.content or "", choice.finish_reason
        found = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls or []]
    assert (content, found, finish) == ("", [("get_weather", {"city": "Oslo"})], "tool_calls")


@pytest.mark.parametrize("model", SCRIPTS)
def test_without_tools_the_markers_are_special_tokens_the_text_leaves_out(gw, model):
    """No tools: no parser reads the markers, so the detokenizer skips them as every special token."""
    answer = gw.openai(timeout=300).chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Weather in Oslo?"}], temperature=0, max_tokens=64)
    text = SCRIPTS[model][1]
    for marker in MARKERS:
        text = text.replace(marker, "")
    assert answer.choices[0].message.content == text and not answer.choices[0].message.tool_calls
