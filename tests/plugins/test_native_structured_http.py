"""Structured outputs on the native engine behind a live gateway, through the real openai client.

SmolLM2 answers under every kind of constraint a client can send: OpenAI's response_format (a
pydantic model through `chat.completions.parse`, a raw json_schema, json_object) and vLLM's
structured_outputs (regex, choice, a GBNF grammar). Every output is checked against its
constraint by an independent judge (`jsonschema`, Python's `re`), sampled at temperature 1 with
seeds, so the mask, not the model's good manners, makes it valid. Bad input (a constraint the
grammar library refuses, one over server.limits.max_grammar_bytes, a tool_choice naming no tool,
a tool whose parameters are no object schema) is a 400 naming the path, sent while a batch runs,
and the batch completes. /tokenize counts a chat's tools as its generation does. A tool round
trip's greedy answer is transformers' from the same prompt ids.
"""

import concurrent.futures
import json
import re
import time

import httpx
import jsonschema
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel

from tests.support.servers.loopback import native_gateway_fixtures

pytestmark = pytest.mark.timeout(900)

CONFIG = """
server:
  limits: {max_grammar_bytes: 4096}
models:
  - name: smollm2
    timeouts: {first_token_s: 600}  # a loaded CI box: the first constrained request builds the compiler
    deployments:
      - name: native-0
        backend: native
        settings: {max_num_seqs: 8, max_num_batched_tokens: 128, kv_cache_bytes: 134217728, num_threads: 2}
"""

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "languages": {"type": "array", "items": {"enum": ["en", "fr", "de"]}, "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "age", "languages"],
    "additionalProperties": False,
}
SAMPLED = dict(temperature=1.0, max_tokens=80)


class City(BaseModel):
    name: str
    country: str
    population: int


gw, client = native_gateway_fixtures(CONFIG, client_timeout=300)


def chat(client, content, **kw):
    """One user turn to SmolLM2; the constraint and sampling come in `kw`."""
    return client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": content}], **kw)


def test_parse_with_a_pydantic_model(client):
    out = client.chat.completions.parse(
        model="smollm2", messages=[{"role": "user", "content": "Describe Paris as JSON."}],
        response_format=City, seed=1, **SAMPLED)
    choice = out.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, City)  # the SDK parsed and validated it
    jsonschema.validate(json.loads(choice.message.content), City.model_json_schema())


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_json_schema_outputs_validate(client, seed):
    out = chat(client, "Give me a person as JSON.", seed=seed, n=2, **SAMPLED,
               response_format={"type": "json_schema",
                                "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    for choice in out.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_streamed_json_schema_output_validates(client):
    stream = chat(client, "Give me a person as JSON.", seed=7, stream=True, **SAMPLED,
                  response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    chunks = [c for c in stream if c.choices]
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text), PERSON)


def test_json_object_is_an_object(client):
    out = chat(client, "List two fruits with their colours, as JSON.", seed=4,
               response_format={"type": "json_object"}, **SAMPLED)
    assert out.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(out.choices[0].message.content), dict)


def test_max_tokens_cuts_a_constrained_output_with_length(client):
    out = chat(client, "Give me a person as JSON.", seed=5, temperature=1.0, max_tokens=4,
               response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 4
    assert out.choices[0].message.content.startswith("{")


@pytest.mark.parametrize("seed", [1, 2])
def test_regex(client, seed):
    pattern = r"[A-Z][a-z]{2,8} [0-9]{1,3}(\.[0-9])?"
    out = chat(client, "Name a city and a temperature.", seed=seed, **SAMPLED,
               extra_body={"structured_outputs": {"regex": pattern}})
    assert out.choices[0].finish_reason == "stop"
    assert re.fullmatch(pattern, out.choices[0].message.content)


def test_choice_and_its_logprobs_come_after_the_mask(client):
    choices = ["yes", "no", "maybe"]
    out = chat(client, "Is the sky green?", seed=3, logprobs=True, top_logprobs=10, **SAMPLED,
               extra_body={"structured_outputs": {"choice": choices}})
    choice = out.choices[0]
    assert choice.message.content in choices
    first = choice.logprobs.content[0]
    allowed = [t for t in first.top_logprobs if t.logprob > -9999.0]
    assert allowed and all(any(c.startswith(t.token) for c in choices) for t in allowed)
    # After the mask the allowed tokens hold all the probability (before it, they held far less).
    assert sum(2.718281828459045 ** t.logprob for t in allowed) == pytest.approx(1.0, abs=1e-3)


def test_gbnf_grammar(client):
    grammar = 'root ::= "The answer is " [0-9]+ "."'
    out = chat(client, "What is six times seven?", seed=2, **SAMPLED,
               extra_body={"structured_outputs": {"grammar": grammar}})
    assert re.fullmatch(r"The answer is [0-9]+\.", out.choices[0].message.content)


def test_completions_endpoint_is_constrained_too(client):
    out = client.completions.create(model="smollm2", prompt="A random number:", seed=1, **SAMPLED,
                                    extra_body={"structured_outputs": {"regex": "[0-9]{4}"}})
    assert re.fullmatch("[0-9]{4}", out.choices[0].text)


def tool(name: str, description: str = "", parameters: dict | None = None) -> dict:
    return {"type": "function", "function": {"name": name, "description": description,
                                             **({"parameters": parameters} if parameters is not None else {})}}


# Each under every gateway size limit, over the engine's 4096 bytes of grammar (the tools': their
# parameter schemas together).
BIG_GRAMMAR = "root ::= " + " | ".join(f'"word{i}"' for i in range(500))
MANY_TOOLS = [tool(f"t{i}", parameters={"type": "object", "description": "x" * 2500}) for i in range(2)]
BAD = [
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": BIG_GRAMMAR}}, "structured_outputs.grammar"),
    ({"tools": MANY_TOOLS, "tool_choice": "required"}, "tools"),
    ({"tools": [tool("f")], "tool_choice": {"type": "function", "function": {"name": "g"}}},
     "tool_choice.function.name"),
    ({"tools": [tool("f", parameters={"type": "strin"})]}, "tools[0].function.parameters.type"),
    ({"tools": [tool("f", parameters={"type": "string"})]}, "tools[0].function.parameters.type"),
    ({"tools": [tool("f", parameters={"type": "object", "properties": {"a": {"type": "string", "pattern": "("}}})],
      "tool_choice": "required"}, "tools"),  # the library refuses the pattern
    ({"structured_outputs": {"grammar": "root ::= missing_rule"}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"regex": "[0-9]+", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "string", "pattern": "(unclosed"}}}}, "response_format.json_schema.schema"),
]


def test_refused_constraints_are_400s_while_a_batch_runs(client):
    """Each refusal names the parameter; the requests already running finish untouched."""
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        batch = [pool.submit(chat, client, "Give me a person as JSON.", seed=s, temperature=1.0, max_tokens=60,
                             response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}})
                 for s in range(3)]
        for body, param in BAD:
            with pytest.raises(openai.BadRequestError) as caught:
                chat(client, "Hi", max_tokens=5, extra_body=body)
            assert caught.value.body["param"] == param, caught.value.body
        for future in batch:
            out = future.result()
            assert out.choices[0].finish_reason == "stop"
            jsonschema.validate(json.loads(out.choices[0].message.content), PERSON)


def test_a_schema_keyword_the_engine_lacks_is_the_clients_400_not_the_deployments(gw, client):
    """The engine refuses uniqueItems after routing; kvgate_requests_total counts that 400 under
    no deployment, as the gateway's own refusals, not under native-0."""
    def requests_400(deployment):
        families = text_string_to_metric_families(httpx.get(gw.base_url + "/metrics").text)
        return sum(s.value for f in families for s in f.samples if s.name == "kvgate_requests_total"
                   and s.labels["status"] == "400" and s.labels["deployment"] == deployment)

    before = requests_400("native-0"), requests_400("")
    schema = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    with pytest.raises(openai.BadRequestError) as caught:
        chat(client, "Hi", max_tokens=5, response_format={"type": "json_schema", "json_schema": {
            "name": "u", "schema": schema}})
    assert caught.value.body["param"].startswith("response_format"), caught.value.body
    assert (requests_400("native-0"), requests_400("")) == (before[0], before[1] + 1)


def test_the_compile_cache_is_counted(gw, client):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
    before = _metric(gw, "kvgate_engine_grammar_cache_hits_total")
    for seed in (1, 2):
        chat(client, "A number as JSON.", seed=seed, response_format=fmt, **SAMPLED)
    assert _metric(gw, "kvgate_engine_grammar_cache_hits_total") >= before + 1
    assert _metric(gw, "kvgate_engine_grammar_compiles_total") >= 1


def _metric(gw, name: str) -> float:
    time.sleep(0.5)  # the engine's stats reach the gateway every stats interval
    families = text_string_to_metric_families(httpx.get(gw.base_url + "/metrics").text)
    return sum(s.value for f in families for s in f.samples if s.name == name)


# ------------------------------------------------------------------------------ tool calling

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "description": "The time now."}}
TOOLS = [WEATHER, CLOCK]


def check_calls(tool_calls, allowed=("get_weather", "get_time")):
    assert tool_calls
    for call in tool_calls:
        assert call.type == "function" and call.id and call.function.name in allowed
        arguments = json.loads(call.function.arguments)
        if call.function.name == "get_weather":
            jsonschema.validate(arguments, WEATHER["function"]["parameters"])
        else:
            assert arguments == {}


@pytest.mark.parametrize("seed", [1, 2])
def test_tool_choice_required_always_gives_a_valid_call(client, seed):
    out = chat(client, "What is the weather in Oslo?", seed=seed, tools=TOOLS, tool_choice="required",
               parallel_tool_calls=False, **SAMPLED)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    check_calls(choice.message.tool_calls)


def test_parallel_calls_are_each_valid(client):
    """With parallel calls allowed the grammar lets the model go on calling (a small model often
    does, until max_tokens); every call that came out whole is valid."""
    out = chat(client, "Weather in Oslo and in Rome?", seed=6, tools=TOOLS, tool_choice="required", **SAMPLED)
    choice = out.choices[0]
    assert choice.finish_reason in ("tool_calls", "length")
    check_calls(choice.message.tool_calls)


def test_a_named_tool_is_the_one_called_once(client):
    out = chat(client, "Hello!", seed=3, tools=TOOLS, **SAMPLED,
               tool_choice={"type": "function", "function": {"name": "get_weather"}})
    [call] = out.choices[0].message.tool_calls
    check_calls([call], allowed=("get_weather",))


def test_streamed_tool_calls_come_as_openai_fragments(client):
    stream = chat(client, "Weather in Rome, please.", seed=4, tools=TOOLS, tool_choice="required",
                  parallel_tool_calls=False, stream=True, **SAMPLED)
    fragments, finish = [], None
    for chunk in stream:
        if chunk.choices:
            calls = chunk.choices[0].delta.tool_calls or []
            indexes = [c.index for c in calls]
            assert len(indexes) == len(set(indexes)), f"a chunk repeats a tool call's index: {calls}"
            fragments += calls
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    first = fragments[0]
    assert first.index == 0 and first.id and first.function.name in ("get_weather", "get_time")
    assert all(f.index == 0 and f.id is None and not f.function.name for f in fragments[1:])
    arguments = json.loads("".join(f.function.arguments or "" for f in fragments))
    if first.function.name == "get_weather":
        jsonschema.validate(arguments, WEATHER["function"]["parameters"])


def test_a_llama3_json_deployment_calls_in_its_format(gw, client, monkeypatch):
    """`tool_call_parser: llama3_json` (set on the running deployment, as its setting does at
    start: no second engine): `required` is constrained into Llama 3's bare JSON calls, which
    that parser reads back into valid OpenAI calls."""
    from kvgate_native.tool_parsers import tool_parser

    outputs = []  # each choice's text as the model wrote it

    class Recording(tool_parser("llama3_json")):
        def __init__(self, max_calls=None):
            super().__init__(max_calls)
            self.pieces = []
            outputs.append(self.pieces)

        def push(self, text):
            self.pieces.append(text)
            return super().push(text)

    monkeypatch.setattr(gw.backend("native-0"), "tool_parser", Recording)
    out = chat(client, "What is the weather in Oslo?", seed=8, n=2, tools=TOOLS, tool_choice="required",
               parallel_tool_calls=False, **SAMPLED)
    for choice in out.choices:
        assert choice.finish_reason == "tool_calls" and not choice.message.content
        assert len(choice.message.tool_calls) == 1
        check_calls(choice.message.tool_calls)
    assert len(outputs) == 2
    for pieces in outputs:
        assert re.fullmatch(r'\{"name": "get_\w+", "parameters": \{.*\}\}', "".join(pieces)), pieces


def reference_answer(prompt_ids: list[int], max_tokens: int) -> str:
    """transformers' greedy continuation of the prompt (the default GGUF dequantized to float32,
    as this engine serves it), up to the end of the turn, as text."""
    import os

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from native_backend.model.loader import default_gguf_path

    path = default_gguf_path()
    where = dict(pretrained_model_name_or_path=os.path.dirname(path), gguf_file=os.path.basename(path))
    tokenizer = AutoTokenizer.from_pretrained(**where)
    model = AutoModelForCausalLM.from_pretrained(**where, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_tokens, do_sample=False,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
    return tokenizer.decode(out[0, len(prompt_ids):], skip_special_tokens=True)


def test_a_tool_round_trip(gw, client):
    """The call, its result as a tool message, and the model's greedy answer with the tools still
    on offer (tool_choice auto: unconstrained), which is what transformers generates from the same
    prompt ids: its text, or the call it writes. With tool_choice none: text, no call."""
    question = [{"role": "user", "content": "What is the weather in Oslo?"}]
    call = chat(client, question[0]["content"], seed=5, tools=[WEATHER], tool_choice="required", **SAMPLED)
    [tool_call] = call.choices[0].message.tool_calls[:1]
    messages = question + [
        {"role": "assistant", "content": None, "tool_calls": [tool_call.model_dump()]},
        {"role": "tool", "tool_call_id": tool_call.id, "content": "12 degrees and sunny"},
    ]
    prompt = httpx.post(gw.base_url + "/tokenize", json={"model": "smollm2", "messages": messages, "tools": [WEATHER]},
                        timeout=60).json()["tokens"]
    expected = reference_answer(prompt, 32)
    out = client.chat.completions.create(model="smollm2", messages=messages, tools=[WEATHER], tool_choice="auto",
                                         temperature=0, max_tokens=32)
    choice = out.choices[0]
    assert out.usage.prompt_tokens == len(prompt)
    if "<tool_call>" in expected:  # the Hermes call format: the reference calls a tool again
        assert choice.finish_reason == "tool_calls", (expected, choice)
        check_calls(choice.message.tool_calls)
    else:
        assert choice.message.tool_calls is None and choice.message.content == expected, (expected, choice)
    out = client.chat.completions.create(model="smollm2", messages=messages, tools=[WEATHER], tool_choice="none",
                                         seed=5, **SAMPLED)
    assert out.choices[0].message.tool_calls is None and out.choices[0].message.content


def test_tokenize_counts_the_tools_as_the_generation_does(gw, client):
    messages = [{"role": "user", "content": "What is the weather in Oslo?"}]

    def count(**extra):
        r = httpx.post(gw.base_url + "/tokenize", json={"model": "smollm2", "messages": messages, **extra}, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["count"]

    out = client.chat.completions.create(model="smollm2", messages=messages, tools=TOOLS, max_tokens=1)
    assert count(tools=TOOLS) == out.usage.prompt_tokens > count() + 100  # the Hermes prompt lists the tools


def test_models_and_openapi_declare_structured_outputs_and_tools(gw):
    """The native deployment declares what it serves, so the gateway routes such requests to it."""
    card = next(m for m in httpx.get(gw.base_url + "/v1/models").json()["data"] if m["id"] == "smollm2")
    assert {"json_object", "json_schema", "tools"} <= set(card["capabilities"]["features"])
    doc = httpx.get(gw.base_url + "/openapi.json").json()
    chat_body = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert {"structured_outputs", "tools", "tool_choice", "response_format"} <= set(chat_body["properties"])


def test_skip_special_tokens_false_shows_the_special_tokens(client):
    """vLLM's skip_special_tokens: false on the native engine, through the openai client's extra_body:
    SmolLM2 run past its end of turn (ignore_eos) writes <|im_end|> and <|im_start|>, which the text
    shows only then; the EOS that ends a request is no text either way (as in vLLM)."""
    kw = dict(temperature=0, max_tokens=16, extra_body={"ignore_eos": True})
    skipped = chat(client, "Hi", **kw).choices[0].message.content
    kw["extra_body"]["skip_special_tokens"] = False
    shown = chat(client, "Hi", **kw).choices[0].message.content
    assert "<|im_end|>" in shown and "<|im_start|>" in shown and "<|im_" not in skipped
    assert shown.replace("<|im_end|>", "").replace("<|im_start|>", "") == skipped
    ended = chat(client, "Hi", temperature=0, max_tokens=32, extra_body={"skip_special_tokens": False}).choices[0]
    assert ended.finish_reason == "stop" and ended.message.content == shown[:shown.index("<|im_end|>")]
    with pytest.raises(openai.BadRequestError) as refused:
        chat(client, "hi", max_tokens=1, extra_body={"skip_special_tokens": "no"})
    assert refused.value.body["param"] == "skip_special_tokens"


# bench/structured_battery.py's schemas of the kinds the main tier's flat ones leave out: $defs and
# $ref (a recursive one), anyOf / oneOf, arrays of objects, patterns and formats
BATTERY = ("defs", "tree", "anyof", "oneof_shape", "mixed_array", "list_obj", "team", "pattern_phone",
           "pattern_date", "format_date", "format_email", "address")


@pytest.mark.slow
def test_battery_schemas_sampled_at_temperature_1_validate(client):
    """Each through the engine at temperature 1 with its own seed, all at once (one batch), judged
    by jsonschema with its format checker: the mask makes them valid, whatever the model would
    rather write. An answer cut by max_tokens would be no JSON: it fails too."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    from structured_battery import SCHEMAS

    cases = [(name, schema, ask) for name, schema, ask in SCHEMAS if name in BATTERY]
    assert [name for name, _, _ in cases] == [n for n in (s[0] for s in SCHEMAS) if n in BATTERY]
    assert len(cases) == len(BATTERY)

    def ask(seed_case):
        seed, (name, schema, request) = seed_case
        out = chat(client, request, seed=seed, temperature=1.0, max_tokens=400, response_format={
            "type": "json_schema", "json_schema": {"name": name, "schema": schema}})
        return name, schema, out.choices[0]

    with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
        answers = list(pool.map(ask, enumerate(cases, start=11)))
    for name, schema, choice in answers:
        assert choice.finish_reason == "stop", (name, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), schema,
                            format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
