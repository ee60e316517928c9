"""Hostile bodies at the edge: numbers of any size, any nesting, any Unicode, any list length.

Each gets a 400 OpenAI-style error naming the parameter (never a 500), no deployment's breaker
is charged, and the gateway serves the next request as before. A request's total work is bounded
by `server.limits` (prompts, choices, token ids, stop criteria).
"""

import json

import httpx
import pytest

from tests.support.servers.loopback import GatewayServer

CONFIG = """
server:
  limits: {max_prompts: 4, max_choices: 6, max_prompt_tokens: 50, max_stop_token_ids: 3,
           max_stop_chars: 10, max_json_depth: 8, max_n: 4}
models:
  - name: echo
    breaker: {failures: 1, cooldown_s: 60}
    deployments:
      - {name: echo-0, backend: echo}
"""

MSG = [{"role": "user", "content": "one two three"}]


@pytest.fixture(scope="module")
def gw():
    with GatewayServer(CONFIG) as server:
        yield server


def post(gw, path, body=None, content=None):
    return httpx.post(gw.base_url + path, json=body, content=content, timeout=10,
                      headers={"content-type": "application/json"})


ANY = object()


def assert_400(response, param=ANY):
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error", error
    assert param is ANY or error["param"] == param, error
    return error


def assert_still_serving(gw):
    deployment = gw.state.registry.deployments()[0]
    assert deployment.breaker.consecutive_failures == 0 and deployment.breaker.state == "closed"
    r = post(gw, "/v1/chat/completions", {"model": "echo", "messages": MSG})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]


@pytest.mark.parametrize("raw, param", [
    (b'{"model": "echo", "prompt": "a", "temperature": NaN}', None),
    (b'{"model": "echo", "prompt": "a", "temperature": Infinity}', None),
    (b'{"model": "echo", "prompt": "a", "top_p": 1e999}', None),
    (b'{"model": "echo", "prompt": "a", "seed": ' + b"9" * 5000 + b"}", None),
    (b'{"model": "echo", "prompt": "a", "metadata": ' + b'{"a": ' * 20000 + b"1" + b"}" * 20000 + b"}", None),
])
def test_numbers_and_nesting_a_json_parser_would_take(gw, raw, param):
    assert_400(post(gw, "/v1/completions", content=raw), param)
    assert_still_serving(gw)


def test_nesting_over_the_limit_names_where(gw):
    deep = {"a": {"b": {"c": {"d": {"e": {"f": {"g": {"h": 1}}}}}}}}
    error = assert_400(post(gw, "/v1/completions", {"model": "echo", "prompt": "a", "metadata": deep}),
                       "metadata.a.b.c.d.e.f.g")
    assert "deeper than 8" in error["message"]


@pytest.mark.parametrize("field, value", [
    ("seed", 2**63), ("seed", -1), ("seed", 10**40), ("top_k", 2**31), ("top_k", -2),
    ("n", 10**30), ("max_tokens", 10**30), ("logprobs", 10**30), ("temperature", 1e308),
    ("presence_penalty", -1e308), ("repetition_penalty", 0.0), ("stop_token_ids", [2**31]),
    ("stop_token_ids", [-1]), ("user", "u" * 513),
])
def test_numbers_are_bounded_for_every_backend(gw, field, value):
    body = {"model": "echo", "prompt": "a", field: value}
    param = assert_400(post(gw, "/v1/completions", body))["param"]
    assert param is not None and param.split("[")[0] == field
    assert_still_serving(gw)


def test_token_prompt_ids_are_bounded(gw):
    assert_400(post(gw, "/v1/completions", {"model": "echo", "prompt": [1, 2**31]}), "prompt")
    assert_400(post(gw, "/v1/completions", {"model": "echo", "prompt": [[1], [-5]]}), "prompt")


@pytest.mark.parametrize("where", ["content", "name", "key"])
def test_lone_surrogates_are_refused_by_name(gw, where):
    message = {"role": "user", "content": "hi \ud800 there"} if where == "content" else \
        {"role": "user", "content": "hi", "name": "\udfff"} if where == "name" else {"role": "user", "content": "x"}
    body = {"model": "echo", "messages": [message]}
    if where == "key":
        body["metadata"] = {"\ud83d": "v"}
    raw = json.dumps(body).encode()  # ASCII JSON: the surrogates travel as \\udXXX escapes
    param = {"content": "messages[0].content", "name": "messages[0].name", "key": "metadata"}[where]
    error = assert_400(post(gw, "/v1/chat/completions", content=raw), param)
    assert "surrogate" in error["message"]
    assert_still_serving(gw)


def test_nul_and_other_unicode_are_just_text(gw):
    text = "nul\x00 tab\t emoji \U0001F600 rtl \u202e combining e\u0301 bom \ufeff"
    words = text.split()
    r = post(gw, "/v1/completions", {"model": "echo", "prompt": text, "max_tokens": len(words)})
    assert r.status_code == 200
    assert r.json()["choices"][0]["text"].split() == words


@pytest.mark.parametrize("body, param", [
    ({"prompt": ["a"] * 5}, "prompt"),  # max_prompts 4
    ({"prompt": ["a"] * 4, "n": 2}, "n"),  # 8 choices > max_choices 6
    ({"prompt": [[1] * 30, [2] * 30]}, "prompt"),  # 60 token ids > max_prompt_tokens 50
    ({"prompt": "a", "stop_token_ids": [1, 2, 3, 4]}, "stop_token_ids"),
    ({"prompt": "a", "stop": "x" * 11}, "stop"),
])
def test_a_requests_total_work_is_bounded(gw, body, param):
    assert_400(post(gw, "/v1/completions", {"model": "echo", **body}), param)


def test_within_the_bounds_all_choices_run(gw):
    r = post(gw, "/v1/completions", {"model": "echo", "prompt": ["a b", "c d", "e f"], "n": 2, "max_tokens": 2})
    assert r.status_code == 200 and len(r.json()["choices"]) == 6


@pytest.mark.parametrize("kind", [[], {}, [[], 3], 1.5, None])
def test_a_response_format_type_that_is_not_a_string_is_a_400(gw, kind):
    """Found by the fuzz tier: an unhashable `type` was a 500."""
    assert_400(post(gw, "/v1/chat/completions", {"model": "echo", "messages": MSG, "response_format": {"type": kind}}),
               "response_format")
    assert_still_serving(gw)
