"""LoRA adapters named as models, over HTTP with the openai client (issue 43 item 5): a tiny Llama
(SmolLM2's tokenizer) on a native engine with one static adapter from YAML (vLLM's name=path
form) and one loaded at run time through POST /v1/load_lora_adapter; each answers with the greedy
tokens of its own PeftModel (peft made the adapters, transformers ran them), the base with the
base's; /v1/models lists the adapters as vLLM does (parent, root); bad loads and unloads get
OpenAI-style errors; an unloaded adapter is a model no more; a key's allow-list names adapters;
an adapter placed in lora_resolver_dir is served from its first request."""

from __future__ import annotations

import concurrent.futures
import copy
import os
import shutil

import httpx
import openai
import peft
import pytest
import tokenizers
import torch
import transformers

from native_backend.model.loader import default_gguf_path
from native_backend.text.tokenizer import gguf_tokenizer_dir
from tests.support.servers.loopback import native_gateway

pytestmark = pytest.mark.timeout(900)

ADMIN_ENV, ADMIN = "KVGATE_TEST_LORA_ADMIN", "admin-key-for-lora"
TENANT_ENV, TENANT = "KVGATE_TEST_LORA_TENANT", "tenant-key-for-lora"
ALL_ENV, ANY = "KVGATE_TEST_LORA_ALL", "all-models-key-for-lora"
PROMPT = [520, 1035, 314, 253, 1145, 30]  # token ids: no chat template between the client and the model
MAX_TOKENS = 6
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {"sql": (dict(r=4, lora_alpha=8, target_modules=ALL), 1),
            "chat": (dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"]), 2)}


def _ascii_head(model: transformers.LlamaForCausalLM, tokenizer: tokenizers.Tokenizer) -> None:
    """Zero the LM head's rows of special tokens and of tokens whose text is not printable ASCII:
    greedy then picks a token whose text decodes alone (the best of ~30k random logits is > 0),
    so the client's text compares with the tokenizer's decoding of the reference ids."""
    special = {t.id if hasattr(t, "id") else t for t in tokenizer.get_added_tokens_decoder()}
    with torch.no_grad():
        for i in range(tokenizer.get_vocab_size()):
            text = tokenizer.decode([i], skip_special_tokens=False)
            if i in special or not text or not all(32 <= ord(c) < 127 for c in text):
                model.lm_head.weight[i].zero_()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(base dir, {adapter: dir}, {None | adapter: greedy text of transformers/PeftModel})."""
    root = tmp_path_factory.mktemp("lora-http")
    tokenizer_dir = gguf_tokenizer_dir(default_gguf_path(), root / "tok")
    tokenizer = tokenizers.Tokenizer.from_file(os.path.join(tokenizer_dir, "tokenizer.json"))
    config = transformers.LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(), hidden_size=64, intermediate_size=112, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
        tie_word_embeddings=False, initializer_range=0.15, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).eval()
    _ascii_head(hf, tokenizer)
    base = root / "base"
    hf.save_pretrained(base, safe_serialization=True)
    for name in os.listdir(tokenizer_dir):
        shutil.copy(os.path.join(tokenizer_dir, name), base)
    dirs, expected = {}, {None: _greedy_text(hf, tokenizer)}
    for name, (settings, seed) in ADAPTERS.items():
        torch.manual_seed(seed)
        lora = peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(init_lora_weights=False, lora_dropout=0.0,
                                                                      **settings)).eval()
        lora.save_pretrained(root / name)
        dirs[name], expected[name] = str(root / name), _greedy_text(lora, tokenizer)
    shutil.copytree(dirs["chat"], root / "resolver" / "fs-chat")  # served on its first request
    dirs["resolver"] = str(root / "resolver")
    assert len(set(expected.values())) == 3, expected  # each adapter changes what the model says
    return str(base), dirs, expected


def _greedy_text(model, tokenizer) -> str:
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPT]), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                             do_sample=False)
    return tokenizer.decode(out[0, len(PROMPT):].tolist())


@pytest.fixture(scope="module")
def gw(models, tmp_path_factory):
    base, dirs, _ = models
    os.environ[ADMIN_ENV], os.environ[TENANT_ENV], os.environ[ALL_ENV] = ADMIN, TENANT, ANY
    config = f"""
auth:
  admin_key_env: {ADMIN_ENV}
  keys:
    - {{name: tenant, key_env: {TENANT_ENV}, models: [tiny, sql]}}
    - {{name: everyone, key_env: {ALL_ENV}, models: ["*"]}}
models:
  - name: tiny
    deployments:
      - name: tiny-0
        backend: native
        settings: {{model: {base}, enable_lora: true, max_loras: 2, max_lora_rank: 8, num_threads: 1,
                   kv_cache_bytes: 16777216, lora_modules: ["sql={dirs['sql']}"],
                   lora_resolver_dir: {dirs['resolver']}}}
"""
    with native_gateway(config, tmp_path_factory) as server:
        yield server


def client(gw, key: str = ANY) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.base_url + "/v1", api_key=key, max_retries=0, timeout=300)


def admin(gw, path: str, body: dict, key: str = ADMIN) -> httpx.Response:
    return httpx.post(gw.base_url + path, json=body, headers={"authorization": f"Bearer {key}"}, timeout=120)


def complete(gw, model: str, key: str = ANY):
    return client(gw, key).completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                              extra_body={"ignore_eos": True})


def test_a_static_adapter_and_the_base_answer_with_their_own_reference_tokens(gw, models):
    _, _, expected = models
    for model, adapter in (("sql", "sql"), ("tiny", None)):
        answer = complete(gw, model)
        assert (answer.model, answer.choices[0].text) == (model, expected[adapter])


def test_v1_models_lists_each_adapter_with_parent_and_root_as_vllm_does(gw, models):
    _, dirs, _ = models
    cards = {m.id: m.model_dump() for m in client(gw).models.list().data}
    assert cards["tiny"]["parent"] is None
    sql = cards["sql"]
    assert (sql["object"], sql["parent"], sql["root"], sql["max_model_len"]) == ("model", "tiny", dirs["sql"], None)


def test_an_adapter_loaded_at_run_time_serves_and_unloads_with_vllms_answers(gw, models):
    _, dirs, expected = models
    loaded = admin(gw, "/v1/load_lora_adapter", {"lora_name": "chat", "lora_path": dirs["chat"]})
    assert (loaded.status_code, loaded.text) == (200, "Success: LoRA adapter 'chat' added successfully.")
    assert "chat" in {m.id for m in client(gw).models.list().data}
    assert complete(gw, "chat").choices[0].text == expected["chat"]
    assert complete(gw, "sql").choices[0].text == expected["sql"]  # the two adapters side by side

    again = admin(gw, "/v1/load_lora_adapter", {"lora_name": "chat", "lora_path": dirs["chat"]})
    assert again.status_code == 400 and "has already been loaded" in again.json()["error"]["message"]
    unloaded = admin(gw, "/v1/unload_lora_adapter", {"lora_name": "chat"})
    assert (unloaded.status_code, unloaded.text) == (200, "Success: LoRA adapter 'chat' removed successfully.")
    with pytest.raises(openai.NotFoundError) as gone:
        complete(gw, "chat")
    assert gone.value.body["code"] == "model_not_found"
    assert "chat" not in {m.id for m in client(gw).models.list().data}


@pytest.mark.parametrize("path, body, status, param", [
    ("/v1/load_lora_adapter", {"lora_name": "x"}, 400, "lora_path"),
    ("/v1/load_lora_adapter", {"lora_path": "/tmp"}, 400, "lora_name"),
    ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/nonexistent/adapter"}, 400, "lora_path"),
    ("/v1/load_lora_adapter", {"lora_name": "tiny", "lora_path": "/tmp"}, 400, "lora_name"),
    ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/tmp", "base_model_name": "nope"}, 404, "model"),
    ("/v1/unload_lora_adapter", {"lora_name": "never-loaded"}, 404, "lora_name"),
    ("/v1/unload_lora_adapter", {}, 400, "lora_name"),
])
def test_bad_loads_and_unloads_are_openai_errors_naming_the_field(gw, path, body, status, param):
    answer = admin(gw, path, body)
    error = answer.json()["error"]
    assert (answer.status_code, error["param"]) == (status, param), error
    assert error["message"] and error["type"] == "invalid_request_error"
    assert "x" not in {m.id for m in client(gw).models.list().data}  # nothing half-loaded stays


def test_only_the_admin_key_loads_adapters(gw, models):
    _, dirs, _ = models
    refused = admin(gw, "/v1/load_lora_adapter", {"lora_name": "mine", "lora_path": dirs["chat"]}, key=TENANT)
    assert refused.status_code in (401, 403) and "error" in refused.json()
    assert "mine" not in {m.id for m in client(gw).models.list().data}


def test_a_keys_allow_list_names_adapters_as_models(gw, models):
    _, dirs, expected = models
    assert complete(gw, "sql", key=TENANT).choices[0].text == expected["sql"]
    assert admin(gw, "/v1/load_lora_adapter", {"lora_name": "chat", "lora_path": dirs["chat"]}).status_code == 200
    try:
        with pytest.raises(openai.NotFoundError):  # allowed the base and sql, not chat
            complete(gw, "chat", key=TENANT)
        assert {m.id for m in client(gw, TENANT).models.list().data} == {"tiny", "sql"}
    finally:
        admin(gw, "/v1/unload_lora_adapter", {"lora_name": "chat"})


def test_an_adapter_in_the_resolver_directory_is_served_from_its_first_request(gw, models):
    """vLLM's filesystem resolver: <lora_resolver_dir>/fs-chat is adapter fs-chat, loaded when
    first asked for (several at once load it once), then listed as any other."""
    _, dirs, expected = models
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        texts = list(pool.map(lambda _: complete(gw, "fs-chat").choices[0].text, range(3)))
    assert texts == [expected["chat"]] * 3
    cards = {m.id: m for m in client(gw).models.list().data}
    assert (cards["fs-chat"].parent, cards["fs-chat"].root) == ("tiny", os.path.join(dirs["resolver"], "fs-chat"))
