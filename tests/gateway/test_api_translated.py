"""/v1/responses and /v1/messages through the real `openai` and `anthropic` SDKs against a real
gateway on loopback (the echo backend), with keys, limits, metrics and traces on: each is
served like a chat completion, and answers and errors come in its own API's shapes."""

import anthropic
import httpx
import openai
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from prometheus_client.parser import text_string_to_metric_families

from kvgate_echo import reply_pieces
from tests.support.servers.loopback import GatewayServer

KEY, LIMITED, ADMIN = "sk-translate-0123456789", "sk-limited-0123456789", "sk-admin-translate-0123"
METERED = "sk-metered-0123456789"
CONFIG = f"""
auth:
  admin_key_env: TRANSLATE_ADMIN_KEY
  keys:
    - {{name: team, key: {KEY}}}
    - {{name: limited, key: {LIMITED}, requests_per_minute: 2}}
    - {{name: metered, key: {METERED}, tokens_per_minute: 30}}
models:
  - name: echo
    deployments: [{{name: echo-0, backend: echo}}]
  - name: slow
    deployments: [{{name: slow-0, backend: echo, settings: {{tokens_per_second: 40}}}}]
"""
PROMPT = "the quick brown fox jumps"


def expected(prompt: str, max_tokens: int, stop=()) -> str:
    pieces, _ = reply_pieces(prompt.split(), 0, max_tokens, stop)
    return "".join(p for _, p in pieces)


@pytest.fixture(scope="module")
def served():
    mp = pytest.MonkeyPatch()
    mp.setenv("TRANSLATE_ADMIN_KEY", ADMIN)
    exporter = InMemorySpanExporter()
    with GatewayServer(CONFIG, span_exporter=exporter) as server:
        yield server, exporter
    mp.undo()


@pytest.fixture(scope="module")
def gw(served):
    return served[0]


@pytest.fixture(scope="module")
def oai(gw):
    return openai.OpenAI(base_url=gw.base_url + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def claude(gw):
    return anthropic.Anthropic(base_url=gw.base_url, api_key=KEY, max_retries=0)  # sends x-api-key


# ------------------------------------------------------------------------------ Responses


def test_responses_create_answers_a_response(oai):
    r = oai.responses.create(model="echo", input=PROMPT, instructions="answer briefly", max_output_tokens=6)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == "echo"
    assert r.output_text == expected(PROMPT, 6)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"  # echo fills max_tokens
    assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == (5, 6, 11)


def test_responses_create_takes_message_items(oai):
    r = oai.responses.create(model="echo", max_output_tokens=3, input=[
        {"role": "user", "content": "an earlier question"},
        {"role": "assistant", "content": [{"type": "output_text", "text": "an earlier answer"}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": PROMPT}]}])
    assert r.output_text == expected(PROMPT, 3)


def test_responses_stream_sends_the_events_in_order(oai):
    stream = oai.responses.create(model="echo", input=PROMPT, max_output_tokens=4, stream=True)
    seen = list(stream)
    kinds = [e.type for e in seen]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added"] + ["response.output_text.delta"] * 4 + [
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.incomplete"]
    assert [e.sequence_number for e in seen] == list(range(len(seen)))
    assert "".join(e.delta for e in seen if e.type == "response.output_text.delta") == expected(PROMPT, 4)
    assert seen[-1].response.usage.output_tokens == 4


def test_responses_stream_helper_gathers_the_output(oai):
    # Echo always fills max_output_tokens, so the stream ends incomplete (the helper's final
    # response needs response.completed: test_api_translated_tools has that case).
    with oai.responses.stream(model="echo", input=PROMPT, max_output_tokens=5) as stream:
        seen = list(stream)
    text = "".join(e.delta for e in seen if e.type == "response.output_text.delta")
    assert seen[-1].type == "response.incomplete"
    assert text == seen[-1].response.output_text == expected(PROMPT, 5)


@pytest.mark.parametrize("body, param", [
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": "x", "store": True}, "store"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]}, "input[0].content[0].type"),
])
def test_responses_bad_input_is_an_openai_400_naming_the_path(oai, body, param):
    with pytest.raises(openai.BadRequestError) as caught:
        oai.responses.create(model="echo", **body)
    assert caught.value.status_code == 400 and caught.value.body["param"] == param


# ------------------------------------------------------------------------------ Messages


def test_messages_create_answers_a_message(claude):
    m = claude.messages.create(model="echo", max_tokens=6, system="answer briefly",
                               messages=[{"role": "user", "content": PROMPT}])
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_") and m.model == "echo"
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == expected(PROMPT, 6)
    assert m.stop_reason == "max_tokens" and m.stop_sequence is None
    assert (m.usage.input_tokens, m.usage.output_tokens) == (5, 6)


def test_messages_stop_sequences_end_the_turn(claude):
    m = claude.messages.create(model="echo", max_tokens=10, stop_sequences=["fox"],
                               messages=[{"role": "user", "content": [{"type": "text", "text": PROMPT}]}])
    assert m.content[0].text == expected(PROMPT, 10, ["fox"]) == "the quick brown "
    assert m.stop_reason == "end_turn"


def test_messages_stream_gives_text_and_the_final_message(claude):
    with claude.messages.stream(model="echo", max_tokens=5, messages=[{"role": "user", "content": PROMPT}]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == expected(PROMPT, 5)
    assert final.stop_reason == "max_tokens" and (final.usage.input_tokens, final.usage.output_tokens) == (5, 5)


def test_messages_raw_stream_is_anthropics_event_sequence(gw):
    body = {"model": "echo", "max_tokens": 2, "stream": True, "messages": [{"role": "user", "content": PROMPT}]}
    with httpx.stream("POST", gw.base_url + "/v1/messages", json=body, headers={"x-api-key": KEY}) as r:
        names = [line.removeprefix("event: ") for line in r.iter_lines() if line.startswith("event: ")]
    assert r.headers["content-type"].startswith("text/event-stream")
    assert names == ["message_start", "ping", "content_block_start", "content_block_delta", "content_block_delta",
                     "content_block_stop", "message_delta", "message_stop"]


def test_messages_count_tokens_tokenizes_the_conversation_as_tokenize_does(gw, claude):
    counted = claude.messages.count_tokens(model="echo", system="answer briefly",
                                           messages=[{"role": "user", "content": PROMPT}])
    tokenized = httpx.post(gw.base_url + "/tokenize", headers={"x-api-key": KEY}, json={
        "model": "echo", "messages": [{"role": "system", "content": "answer briefly"},
                                      {"role": "user", "content": PROMPT}]}).json()
    assert counted.input_tokens == tokenized["count"] == 7  # the echo backend: a token per word
    r = httpx.post(gw.base_url + "/v1/messages/count_tokens", headers={"x-api-key": KEY}, json={"model": "echo"})
    assert r.status_code == 400 and r.json()["error"] == {"type": "invalid_request_error",
                                                          "message": "Missing required parameter: 'messages'."}


def test_messages_without_max_tokens_is_anthropics_400(gw):
    body = {"model": "echo", "messages": [{"role": "user", "content": "x"}]}  # (the SDK insists on max_tokens)
    r = httpx.post(gw.base_url + "/v1/messages", json=body, headers={"x-api-key": KEY})
    assert r.status_code == 400
    assert r.json() == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "Missing required parameter: 'max_tokens'."}}


def test_messages_errors_of_every_layer_are_in_anthropics_shape(gw, claude):
    with pytest.raises(anthropic.NotFoundError) as caught:
        claude.messages.create(model="no-such-model", max_tokens=2, messages=[{"role": "user", "content": "x"}])
    assert caught.value.body["error"]["type"] == "not_found_error"
    wrong = anthropic.Anthropic(base_url=gw.base_url, api_key="sk-wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as caught:
        wrong.messages.create(model="echo", max_tokens=2, messages=[{"role": "user", "content": "x"}])
    assert caught.value.body["type"] == "error" and caught.value.body["error"]["type"] == "authentication_error"
    r = httpx.post(gw.base_url + "/v1/messages", content=b"{not json", headers={"x-api-key": KEY})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_messages_count_against_the_keys_requests_per_minute(gw):
    limited = anthropic.Anthropic(base_url=gw.base_url, api_key=LIMITED, max_retries=0)
    for _ in range(2):
        limited.messages.create(model="echo", max_tokens=1, messages=[{"role": "user", "content": "x"}])
    with pytest.raises(anthropic.RateLimitError) as caught:
        limited.messages.create(model="echo", max_tokens=1, messages=[{"role": "user", "content": "x"}])
    assert caught.value.body["error"]["type"] == "rate_limit_error"
    assert int(caught.value.response.headers["retry-after"]) >= 1


def test_responses_count_against_the_keys_tokens_per_minute(gw):
    metered = openai.OpenAI(base_url=gw.base_url + "/v1", api_key=METERED, max_retries=0)
    r = metered.responses.create(model="echo", input=PROMPT, max_output_tokens=12)
    assert r.usage.total_tokens == 17
    metered.responses.create(model="echo", input=PROMPT, max_output_tokens=12)  # 34 tokens now: over 30
    with pytest.raises(openai.RateLimitError) as caught:
        metered.responses.create(model="echo", input=PROMPT, max_output_tokens=1)
    assert "tokens per minute" in caught.value.body["message"]


def test_bad_input_is_never_charged_to_a_breaker(gw, claude, oai):
    for _ in range(5):
        with pytest.raises(anthropic.BadRequestError):
            claude.messages.create(model="echo", max_tokens=2,
                                   messages=[{"role": "user", "content": [{"type": "image"}]}])
        with pytest.raises(openai.BadRequestError):
            oai.responses.create(model="echo", input=[{"type": "unknown"}])
    breaker = next(d.breaker for d in gw.state.registry.deployments() if d.name == "echo-0")
    assert breaker.consecutive_failures == 0 and breaker.state == "closed"


def test_bad_input_leaves_the_requests_in_flight_alone(claude, oai):
    import threading

    texts = {}

    def stream_messages():
        with claude.messages.stream(model="slow", max_tokens=12, messages=[{"role": "user", "content": PROMPT}]) as s:
            texts["messages"] = "".join(s.text_stream)

    def stream_responses():
        with oai.responses.stream(model="slow", input=PROMPT, max_output_tokens=12) as s:
            texts["responses"] = "".join(e.delta for e in s if e.type == "response.output_text.delta")

    threads = [threading.Thread(target=stream_messages), threading.Thread(target=stream_responses)]
    for t in threads:
        t.start()
    for _ in range(10):  # while both stream (12 tokens at 40/s each)
        with pytest.raises(anthropic.BadRequestError):
            claude.messages.create(model="slow", max_tokens=2, messages=[{"role": "user", "content": [{"type": "x"}]}])
        with pytest.raises(openai.BadRequestError):
            oai.responses.create(model="slow", input=[{"type": "x"}])
    for t in threads:
        t.join(30)
    assert texts == {"messages": expected(PROMPT, 12), "responses": expected(PROMPT, 12)}


def test_both_are_metered_and_traced_like_chat(served, claude, oai):
    gw, exporter = served
    before = _completion_tokens(gw)
    claude.messages.create(model="echo", max_tokens=3, messages=[{"role": "user", "content": PROMPT}])
    oai.responses.create(model="echo", input=PROMPT, max_output_tokens=4)
    assert _completion_tokens(gw) == before + 7
    roots = {s.attributes["url.path"]: s for s in exporter.get_finished_spans() if s.kind == SpanKind.SERVER}
    for path in ("/v1/messages", "/v1/responses"):
        assert roots[path].name == "chat echo" and roots[path].attributes["gen_ai.operation.name"] == "chat"


def _completion_tokens(gw) -> float:
    text = httpx.get(gw.base_url + "/metrics", headers={"authorization": f"Bearer {ADMIN}"}).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "kvgate_completion_tokens_sum" and sample.labels["model"] == "echo":
                return sample.value
    return 0.0
