"""cache_salt (vLLM's request field) through the gateway, and the salts it sets for tenants
(issue 40 item 4): a key or SLA class with `cache_salt: per_key` or a fixed string has its
prompts salted whatever its clients send, so one tenant's prefix-cache hits cannot be timed by
another. A loopback vLLM-like upstream records what it received."""

from __future__ import annotations

import hashlib

import httpx
import pytest

from tests.support.fakes.scripted_upstream import ScriptedUpstream
from tests.support.servers.loopback import GatewayServer

KEYS = {"TEST_SALT_A": "sk-tenant-a-0123456789", "TEST_SALT_B": "sk-tenant-b-0123456789",
        "TEST_SALT_T1": "sk-team-one-0123456789", "TEST_SALT_T2": "sk-team-two-0123456789",
        "TEST_SALT_OPEN": "sk-open-key-0123456789", "TEST_SALT_CLASS": "sk-by-class-0123456789"}
CONFIG = """
sla_classes:
  - {{name: standard, priority: 5}}
  - {{name: isolated, priority: 5, cache_salt: per_key}}
auth:
  keys:
    - {{name: a, key_env: TEST_SALT_A, cache_salt: per_key}}
    - {{name: b, key_env: TEST_SALT_B, cache_salt: per_key}}
    - {{name: t1, key_env: TEST_SALT_T1, cache_salt: team-x}}
    - {{name: t2, key_env: TEST_SALT_T2, cache_salt: team-x}}
    - {{name: open, key_env: TEST_SALT_OPEN}}
    - {{name: by-class, key_env: TEST_SALT_CLASS, sla_class: isolated}}
models:
  - name: vllm
    deployments:
      - {{name: v0, backend: openai, upstream_model: scripted, settings: {{base_url: '{base}/v1', server: vllm,
          metrics: none}}}}
  - name: elsewhere
    deployments:
      - {{name: o0, backend: openai, upstream_model: scripted, settings: {{base_url: '{base}/v1', server: openai,
          metrics: none}}}}
"""


@pytest.fixture(scope="module")
def upstream():
    server = ScriptedUpstream()
    yield server
    server.close()


@pytest.fixture(scope="module")
def gw(upstream):
    with pytest.MonkeyPatch.context() as env:
        for name, value in KEYS.items():
            env.setenv(name, value)
        with GatewayServer(CONFIG.format(base=upstream.base_url)) as server:
            yield server


def chat(gw, env: str, model: str = "vllm", **extra) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 2, **extra}
    return httpx.post(gw.base_url + "/v1/chat/completions", json=body, timeout=30,
                      headers={"authorization": f"Bearer {KEYS[env]}"})


def salt_sent(gw, upstream, env: str, **extra) -> str | None:
    before = len(upstream.bodies("/v1/chat/completions"))
    r = chat(gw, env, **extra)
    assert r.status_code == 200, r.text
    [body] = upstream.bodies("/v1/chat/completions")[before:]
    return body.get("cache_salt")


def test_a_keys_salt_is_its_own_whatever_its_clients_send(gw, upstream):
    a, b = salt_sent(gw, upstream, "TEST_SALT_A"), salt_sent(gw, upstream, "TEST_SALT_B")
    assert a and b and a != b and a.startswith("kvgate.")
    assert KEYS["TEST_SALT_A"] not in a and hashlib.sha256(KEYS["TEST_SALT_A"].encode()).hexdigest() not in a
    assert salt_sent(gw, upstream, "TEST_SALT_A") == a  # the same tenant: the same salt, its own hits
    # A client's own salt partitions its tenant's cache further, inside it.
    assert salt_sent(gw, upstream, "TEST_SALT_A", cache_salt="mine") == f"{a}/mine"


def test_keys_naming_one_fixed_salt_share_it_and_others_do_not(gw, upstream):
    t1, t2 = salt_sent(gw, upstream, "TEST_SALT_T1"), salt_sent(gw, upstream, "TEST_SALT_T2")
    assert t1 == t2 != "team-x" and t1.startswith("kvgate.")
    # A key without a salt sends what its client sends, and cannot name a tenant's salt.
    assert salt_sent(gw, upstream, "TEST_SALT_OPEN") is None
    assert salt_sent(gw, upstream, "TEST_SALT_OPEN", cache_salt="team-x") == "team-x" != t1
    r = chat(gw, "TEST_SALT_OPEN", cache_salt=t1)
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"


def test_an_sla_class_salts_each_of_its_keys_apart(gw, upstream):
    by_class = salt_sent(gw, upstream, "TEST_SALT_CLASS")
    assert by_class and by_class.startswith("kvgate.") and by_class != salt_sent(gw, upstream, "TEST_SALT_A")


@pytest.mark.parametrize("value", ["", 7, ["a"], True, None])
def test_a_cache_salt_that_is_not_a_non_empty_string_is_a_400(gw, upstream, value):
    if value is None:  # null: no salt, as vLLM reads it
        assert salt_sent(gw, upstream, "TEST_SALT_OPEN", cache_salt=None) is None
        assert salt_sent(gw, upstream, "TEST_SALT_A", cache_salt=None) == salt_sent(gw, upstream, "TEST_SALT_A")
        return
    r = chat(gw, "TEST_SALT_OPEN", cache_salt=value)
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", r.text


def test_a_salted_tenant_is_refused_where_a_deployment_would_drop_the_salt(gw, upstream):
    """OpenAI itself takes no cache_salt: sending the tenant there unsalted would share its cache."""
    r = chat(gw, "TEST_SALT_A", model="elsewhere")
    assert r.status_code == 400 and "cache_salt" in r.text
    assert chat(gw, "TEST_SALT_OPEN", model="elsewhere").status_code == 200
