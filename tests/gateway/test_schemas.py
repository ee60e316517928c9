"""Request parsing: a request that names no max_tokens is bounded, on every endpoint."""

import json

import pytest

from gateway.config import RequestLimits
from gateway.protocol.completions import parse_chat, parse_completion
from tests.support.servers.loopback import GatewayServer

LIMITS = RequestLimits(max_tokens=8)
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("parse,body", [
    (parse_chat, CHAT),  # what most clients send
    (parse_chat, {**CHAT, "max_tokens": None, "max_completion_tokens": None}),
    (parse_completion, {"model": "m", "prompt": "hi", "max_tokens": None}),
])
def test_no_max_tokens_is_the_servers_bound_marked_as_a_default(parse, body):
    sampling = parse(body, LIMITS).sampling
    assert (sampling.max_tokens, sampling.max_tokens_default) == (8, True)


@pytest.mark.parametrize("parse,body", [
    (parse_chat, {**CHAT, "max_tokens": 5}),
    (parse_chat, {**CHAT, "max_completion_tokens": 5}),
    (parse_completion, {"model": "m", "prompt": "hi", "max_tokens": 5}),
])
def test_a_clients_own_max_tokens_is_not_a_default(parse, body):
    sampling = parse(body, LIMITS).sampling
    assert (sampling.max_tokens, sampling.max_tokens_default) == (5, False)


@pytest.mark.parametrize("parse,body", [
    (parse_chat, CHAT),
    (parse_completion, {"model": "m", "prompt": "hi"}),
])
@pytest.mark.parametrize("value", ["false", 0, None, [False]])
def test_skip_special_tokens_must_be_a_boolean(parse, body, value):
    """vLLM's skip_special_tokens: a vendor field, forwarded as sent, but a boolean or a 400 naming it."""
    from gateway.errors import InvalidRequestError

    assert parse({**body, "skip_special_tokens": False}, LIMITS).extra == {"skip_special_tokens": False}
    with pytest.raises(InvalidRequestError) as refused:
        parse({**body, "skip_special_tokens": value}, LIMITS)
    assert refused.value.param == "skip_special_tokens" and "boolean" in str(refused.value)
    assert str(refused.value).endswith(f"got {json.dumps(value)}.")  # the value as JSON, not a bytes repr


CONFIG = """
server: {limits: {max_tokens: 8}}
models:
  - name: long
    deployments: [{name: long-0, backend: echo, settings: {default_max_tokens: 1000}}]
  - name: short
    deployments: [{name: short-0, backend: echo, settings: {default_max_tokens: 1000, max_context: 12}}]
"""


@pytest.fixture(scope="module")
def client():
    with GatewayServer(CONFIG) as gw:
        yield gw.openai()


def test_a_chat_without_max_tokens_stops_at_the_servers_limit(client):
    """ignore_eos and the backend's own default of 1000 tokens: still the server's 8."""
    out = client.chat.completions.create(model="long", messages=[{"role": "user", "content": "a b c"}],
                                         extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 8 and out.choices[0].finish_reason == "length"
    out = client.completions.create(model="long", prompt="a b c", max_tokens=None, n=2)
    assert [len(c.text.split()) for c in out.choices] == [8, 8]


def test_a_chat_without_max_tokens_gets_what_the_context_leaves_not_a_400(client):
    """Context 12, prompt 7: 5 tokens left, under the bound of 8 (the native engine's cache rule
    is tested on its scheduler); a client's own 8 does not fit and is refused."""
    prompt = "one two three four five six seven"
    out = client.completions.create(model="short", prompt=prompt, max_tokens=None)
    assert out.usage.completion_tokens == 12 - 7
    import openai
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="short", prompt=prompt, max_tokens=8)


def test_over_many_messages_are_refused_before_each_is_validated_and_tool_calls_are_bounded():
    """Issue 40 item 8: 2,000 messages the parser would refuse one by one are refused by their
    count; 300 tool calls in a conversation (one assistant message can hold them all) are over 256."""
    from gateway.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError) as info:
        parse_chat({"model": "m", "messages": [{"role": "nobody"}] * 2000}, LIMITS)
    assert info.value.param == "messages" and "Too many messages: 2000 > 256" in info.value.message
    calls = [{"id": f"c{i}", "type": "function", "function": {"name": "f", "arguments": "{}"}} for i in range(300)]
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": calls}]}
    with pytest.raises(InvalidRequestError) as info:
        parse_chat(body, LIMITS)
    assert info.value.param == "messages" and "300 tool calls, over this server's limit of 256" in info.value.message
    body["messages"][1]["tool_calls"] = calls[:256]
    assert parse_chat(body, LIMITS).messages[1]["tool_calls"][255]["id"] == "c255"
