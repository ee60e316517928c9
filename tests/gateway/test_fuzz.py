"""Fuzz the live gateway from its own OpenAPI schema (`GET /openapi.json`) with schemathesis.

Valid and invalid bodies against the echo backend: no response >= 500, every 4xx an
OpenAI-style error, and the gateway healthy and serving after, its breaker untouched. CI runs
KVGATE_FUZZ_EXAMPLES (default 60) cases per operation and generation mode (a few hundred in
all); the `fuzz` tier runs `KVGATE_FUZZ_EXAMPLES=2500` (>= 10,000 cases, see docs/testing.md).
"""

import json
import os

import httpx
import pytest

from tests.support.checks.fuzz_run import assert_each_pair_ran, examples_for_total, fuzz
from tests.support.servers.loopback import GatewayServer

FUZZ_EXAMPLES = int(os.environ.get("KVGATE_FUZZ_EXAMPLES", "60"))

CONFIG = """
server:
  limits: {max_tokens: 64, max_prompts: 8, max_choices: 16}
models:
  - name: echo
    aliases: [echo-alias]
    deployments:
      - {name: echo-0, backend: echo}
"""


@pytest.fixture(scope="module")
def gw():
    with GatewayServer(CONFIG) as server:
        yield server


def test_the_schema_is_the_request_models_with_this_servers_limits(gw):
    doc = httpx.get(gw.base_url + "/openapi.json").json()
    body = doc["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body["properties"]["model"]["enum"] == ["echo", "echo-alias"]
    assert body["additionalProperties"] is False and "prompt" in body["required"]
    n = [o for o in body["properties"]["n"].get("anyOf", [body["properties"]["n"]]) if o.get("type") == "integer"]
    assert n[0]["maximum"] == 8
    assert set(doc["paths"]) >= {"/v1/completions", "/v1/chat/completions", "/v1/models"}


@pytest.mark.timeout(3600)
def test_no_input_reaches_a_500_and_every_refusal_is_an_openai_error(gw):
    result = fuzz(gw.base_url, FUZZ_EXAMPLES)
    print(f"fuzz (echo): {result}")
    assert_each_pair_ran(result, FUZZ_EXAMPLES)  # really ran
    assert any(400 <= s < 500 for s in result["statuses"]) and 200 in result["statuses"]
    assert httpx.get(gw.base_url + "/health/live").status_code == 200
    r = httpx.post(gw.base_url + "/v1/completions", json={"model": "echo", "prompt": "still here", "max_tokens": 2}, timeout=10)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "still here"
    deployment = gw.state.registry.deployments()[0]
    assert deployment.breaker.state == "closed" and deployment.in_flight == 0


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_fuzz_tier_ten_thousand_cases(gw):
    examples = examples_for_total(gw.base_url, 10_000)  # every operation x both generation modes
    result = fuzz(gw.base_url, examples)
    print(f"fuzz tier (echo): {result}")
    assert result["cases"] >= 10_000
    assert_each_pair_ran(result, examples)
    assert httpx.get(gw.base_url + "/health/live").status_code == 200


def body_validator(doc: dict, path: str):
    """The published request schema of `path` as a JSON Schema validator (refs resolved in doc)."""
    from jsonschema import Draft202012Validator
    from referencing import Registry, Resource

    schema = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    registry = Registry().with_resource("urn:kvgate", Resource.from_contents({**doc, "$schema": Draft202012Validator.META_SCHEMA["$id"]}))
    rebased = json.loads(json.dumps(schema).replace('"#/components', '"urn:kvgate#/components'))
    return Draft202012Validator(rebased, registry=registry)


ACCEPTED = [  # schema-valid, and the server runs them
    ("/v1/completions", {"model": "echo", "prompt": "a b c"}),  # no max_tokens: the default, capped by the limit
    ("/v1/completions", {"model": "echo", "prompt": "a b", "n": 2.0, "seed": 0.0, "max_tokens": 2.0}),
    ("/v1/chat/completions", {"model": "echo", "messages": [{"role": "assistant"}, {"role": "user", "content": "hi"}]}),
]
REFUSED = [  # the server refuses them, and the schema says so
    ("/v1/chat/completions", {"model": "echo", "messages": [{"role": "user"}]}),
    ("/v1/chat/completions", {"model": "echo", "messages": [{"role": "system", "content": None}]}),
    ("/v1/completions", {"model": "echo", "prompt": [[], [1]]}),
    ("/v1/completions", {"model": "echo", "prompt": "a", "n": 1.5}),
]


@pytest.mark.parametrize("path, body", ACCEPTED)
def test_a_schema_valid_body_is_one_the_server_runs(gw, path, body):
    doc = httpx.get(gw.base_url + "/openapi.json").json()
    assert not list(body_validator(doc, path).iter_errors(body))
    r = httpx.post(gw.base_url + path, json=body, timeout=10)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("path, body", REFUSED)
def test_a_body_the_server_refuses_is_not_schema_valid(gw, path, body):
    doc = httpx.get(gw.base_url + "/openapi.json").json()
    assert list(body_validator(doc, path).iter_errors(body))
    r = httpx.post(gw.base_url + path, json=body, timeout=10)
    assert r.status_code == 400, r.text


def test_a_completion_without_max_tokens_is_capped_by_the_servers_limit():
    """OpenAI's default of 16 applies only when the server allows it: a client that did not ask
    for a number is not refused for one it never sent (an explicit 16 still is)."""
    from gateway.config import RequestLimits
    from gateway.errors import InvalidRequestError
    from gateway.protocol.completions import parse_completion

    limits = RequestLimits(max_tokens=3)
    assert parse_completion({"model": "m", "prompt": "x"}, limits).sampling.max_tokens == 3
    assert parse_completion({"model": "m", "prompt": "x"}, RequestLimits()).sampling.max_tokens == 16
    with pytest.raises(InvalidRequestError, match="max_tokens is 16"):
        parse_completion({"model": "m", "prompt": "x", "max_tokens": 16}, limits)
