"""API keys on every route, per-key model allow-lists and limits, keys never logged."""

import logging
import subprocess
import sys
import time

import httpx
import openai
import pytest

from gateway.api.routes import ENDPOINTS
from gateway.config import ConfigError, parse_config
from gateway.keys.limits import KeyLimiter
from gateway.keys.store import KeyStore
from tests.support.servers.loopback import GatewayServer

ALICE, BOB, CAROL, ADMIN = "sk-alice-0123456789", "sk-bob-0123456789", "sk-carol-0123456789", "sk-admin-0123456789"

CONFIG = """
auth:
  admin_key_env: TEST_ADMIN_KEY
  keys_file_env: TEST_KEYS_FILE
  keys:
    - {name: alice, key_env: TEST_ALICE_KEY, models: ["*"], sla_class: interactive, sla_classes: ["*"]}
    - {name: bob, key_env: TEST_BOB_KEY, models: [echo], requests_per_minute: 3, sla_classes: [standard, batch]}
models:
  - name: echo
    deployments: [{name: echo-0, backend: echo}]
  - name: secret-model
    deployments: [{name: secret-0, backend: echo}]
"""


@pytest.fixture()
def gw(monkeypatch, tmp_path):
    keys_file = tmp_path / "keys.yaml"
    keys_file.write_text(f"- {{name: carol, key: {CAROL}, models: [echo], tokens_per_minute: 30, max_concurrency: 1,"
                         " sla_class: batch, sla_classes: [batch]}\n")
    monkeypatch.setenv("TEST_ALICE_KEY", ALICE)
    monkeypatch.setenv("TEST_BOB_KEY", BOB)
    monkeypatch.setenv("TEST_ADMIN_KEY", ADMIN)
    monkeypatch.setenv("TEST_KEYS_FILE", str(keys_file))
    with GatewayServer(CONFIG) as server:
        yield server


def call(gw, method, path, key=None, headers=None, **kw):
    headers = {**({"authorization": f"Bearer {key}"} if key else {}), **(headers or {})}
    return httpx.request(method, gw.base_url + path, headers=headers, timeout=10, **kw)


def test_every_route_but_health_and_version_needs_a_key(gw):
    # Probes (Kubernetes, benchmark clients' /health check) and /version carry no key.
    open_paths = {"/health", "/health/live", "/health/ready", "/version"}
    for route in ENDPOINTS:
        for method in route.methods:
            r = call(gw, method, route.path, json={})
            if route.path in open_paths:
                assert r.status_code == 200, route.path
                continue
            assert r.status_code == 401, (method, route.path)
            assert r.headers["www-authenticate"] == "Bearer"
            assert r.json()["error"]["type"] == "authentication_error"
            wrong = call(gw, method, route.path, key="sk-wrong-0123456789", json={})
            assert wrong.status_code == 401
            if route.path.startswith("/v1/messages"):  # Anthropic's API answers in its shape, which has no code
                assert wrong.json()["type"] == "error" and wrong.json()["error"]["type"] == "authentication_error"
            else:
                assert wrong.json()["error"]["code"] == "invalid_api_key"


def test_valid_key_works_through_the_openai_client(gw):
    client = openai.OpenAI(base_url=gw.base_url + "/v1", api_key=ALICE, max_retries=0)
    assert client.completions.create(model="echo", prompt="a b", max_tokens=2).choices[0].text == "a b"
    bad = openai.OpenAI(base_url=gw.base_url + "/v1", api_key="nope-nope-nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_disallowed_model_looks_like_it_does_not_exist(gw):
    r = call(gw, "POST", "/v1/completions", key=BOB, json={"model": "secret-model", "prompt": "a"})
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "model_not_found"
    assert [m["id"] for m in call(gw, "GET", "/v1/models", key=BOB).json()["data"]] == ["echo"]
    assert len(call(gw, "GET", "/v1/models", key=ALICE).json()["data"]) == 2


def test_requests_per_minute_limit_is_429_with_retry_after(gw):
    for _ in range(3):
        assert call(gw, "POST", "/v1/completions", key=BOB, json={"model": "echo", "prompt": "a"}).status_code == 200
    r = call(gw, "POST", "/v1/completions", key=BOB, json={"model": "echo", "prompt": "a"})
    assert r.status_code == 429
    assert r.json()["error"]["type"] == "rate_limit_error"
    assert 50 <= int(r.headers["retry-after"]) <= 60
    # another key is not affected
    assert call(gw, "POST", "/v1/completions", key=ALICE, json={"model": "echo", "prompt": "a"}).status_code == 200


def test_tokens_per_minute_limit_from_a_keys_file(gw):
    body = {"model": "echo", "prompt": "a b c d e", "max_tokens": 10}  # 15 tokens a request
    assert call(gw, "POST", "/v1/completions", key=CAROL, json=body).status_code == 200
    assert call(gw, "POST", "/v1/completions", key=CAROL, json=body).status_code == 200
    r = call(gw, "POST", "/v1/completions", key=CAROL, json=body)
    assert r.status_code == 429
    assert "30 tokens per minute" in r.json()["error"]["message"]


def test_key_default_sla_class_applies(gw):
    seen = []
    backend = gw.backend("echo-0")
    original = backend.generate
    backend.generate = lambda request: (seen.append(request.priority), original(request))[1]
    call(gw, "POST", "/v1/completions", key=ALICE, json={"model": "echo", "prompt": "a"})
    call(gw, "POST", "/v1/completions", key=BOB, json={"model": "echo", "prompt": "a"})
    assert seen == [0, 5]  # alice: interactive; bob: the config default, standard


def test_key_cannot_ask_for_a_class_above_its_allowance(gw):
    seen = []
    backend = gw.backend("echo-0")
    original = backend.generate
    backend.generate = lambda request: (seen.append(request.priority), original(request))[1]
    body = {"model": "echo", "prompt": "a"}
    refused = call(gw, "POST", "/v1/completions", key=BOB, json=body, headers={"x-sla-class": "interactive"})
    assert refused.status_code == 403
    assert refused.json()["error"] == {
        "message": "Key 'bob' may not use SLA class 'interactive' (allowed: batch, standard).",
        "type": "permission_error", "param": "x-sla-class", "code": "sla_class_not_allowed"}
    assert call(gw, "POST", "/v1/completions", key=BOB, json=body, headers={"x-sla-class": "batch"}).status_code == 200
    assert call(gw, "POST", "/v1/completions", key=CAROL, json=body).status_code == 200  # its default: batch
    assert call(gw, "POST", "/v1/completions", key=CAROL, json=body,
                headers={"x-sla-class": "standard"}).status_code == 403
    assert call(gw, "POST", "/v1/completions", key=ALICE, json=body, headers={"x-sla-class": "batch"}).status_code == 200
    assert seen == [10, 10, 10]  # bob's batch, carol's default, alice's (any class) batch
    with pytest.raises(openai.PermissionDeniedError):
        openai.OpenAI(base_url=gw.base_url + "/v1", api_key=BOB, max_retries=0).completions.create(
            model="echo", prompt="a", extra_headers={"x-sla-class": "interactive"})


@pytest.mark.parametrize("key, message", [
    ("{name: k, key: sk-k-0123456789, sla_classes: [gold]}", "auth.keys[0].sla_classes: unknown class 'gold'"),
    ("{name: k, key: sk-k-0123456789, sla_classes: [batch]}",
     "auth.keys[0].sla_classes: the key's default class 'standard' is not among them (set sla_class to one of them)"),
    ("{name: k, key: sk-k-0123456789, sla_class: interactive, sla_classes: [batch]}",
     "auth.keys[0].sla_classes: the key's default class 'interactive' is not among them"),
])
def test_sla_allowance_is_checked_with_the_config(key, message):
    text = f"auth:\n  keys: [{key}]\nmodels:\n  - name: m\n    deployments: [{{name: d, backend: echo}}]\n"
    with pytest.raises(ConfigError) as info:
        parse_config(text)
    assert any(message in p for p in info.value.problems), info.value.problems


def test_keys_file_allowance_is_checked_by_check_config(tmp_path, monkeypatch):
    keys_file = tmp_path / "keys.yaml"
    keys_file.write_text("- {name: dave, key: sk-dave-0123456789, sla_classes: [interactive]}\n")
    config = tmp_path / "gw.yaml"
    config.write_text("auth: {keys_file_env: TEST_KEYS_FILE}\nmodels:\n  - name: m\n"
                      "    deployments: [{name: d, backend: echo}]\n")
    monkeypatch.setenv("TEST_KEYS_FILE", str(keys_file))
    result = subprocess.run([sys.executable, "-m", "gateway.cli", "check-config", str(config)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert ("keys file [TEST_KEYS_FILE][0].sla_classes: the key's default class 'standard' is not among them"
            in result.stderr)


def test_admin_reload_needs_the_admin_key(gw):
    assert call(gw, "POST", "/admin/reload", key=ALICE).status_code == 401
    r = call(gw, "POST", "/admin/reload", key=ADMIN)
    assert r.status_code == 500  # this test server was not started from a file
    assert "not started from a config file" in r.json()["error"]["message"]


def test_keys_never_appear_in_logs(gw, caplog):
    caplog.set_level(logging.DEBUG)
    call(gw, "POST", "/v1/completions", key=ALICE, json={"model": "echo", "prompt": "a"})
    call(gw, "POST", "/v1/completions", key="sk-wrong-0123456789", json={"model": "echo", "prompt": "a"})
    call(gw, "POST", "/v1/completions", key=BOB, json={"model": "secret-model", "prompt": "a"})
    text = caplog.text
    for secret in (ALICE, BOB, ADMIN, "sk-wrong-0123456789"):
        assert secret not in text
    assert ALICE not in repr(gw.state.keys.keys) and ALICE not in repr(gw.state.config)


def test_missing_key_variable_fails_the_config():
    config = parse_config("auth:\n  keys: [{name: x, key_env: NOPE_NOT_SET}]\nmodels:\n  - name: m\n    deployments: [{name: d, backend: echo}]\n")
    with pytest.raises(ValueError, match=r"auth.keys\[0\].key_env: environment variable NOPE_NOT_SET is not set"):
        KeyStore.from_config(config.auth, env={})


def test_concurrency_limit():
    store = KeyStore.from_config(parse_config(
        f"auth:\n  keys: [{{name: k, key: {CAROL}, max_concurrency: 2}}]\nmodels:\n  - name: m\n    deployments: [{{name: d, backend: echo}}]\n").auth)
    key = store.lookup(CAROL)
    limiter = KeyLimiter()
    limiter.admit(key)
    limiter.admit(key)
    with pytest.raises(Exception, match="already has 2 requests in flight"):
        limiter.admit(key)
    limiter.finish(key, 0)
    limiter.admit(key)


def test_sliding_window_frees_budget_after_a_minute():
    now = [1000.0]
    store = KeyStore.from_config(parse_config(
        f"auth:\n  keys: [{{name: k, key: {CAROL}, requests_per_minute: 2}}]\nmodels:\n  - name: m\n    deployments: [{{name: d, backend: echo}}]\n").auth)
    key = store.lookup(CAROL)
    limiter = KeyLimiter(clock=lambda: now[0])
    limiter.admit(key)
    now[0] += 30
    limiter.admit(key)
    with pytest.raises(Exception) as info:
        limiter.admit(key)
    assert info.value.headers["Retry-After"] == "30"
    now[0] += 30.5
    limiter.admit(key)


def test_rate_limits_count_every_prompt_times_n(gw):
    # bob: 3 requests/min. Two prompts x n=1 is two requests' worth; a third prompt's worth is over.
    # A request bigger than the whole minute can never pass: a 400, not a 429 to retry forever.
    r = call(gw, "POST", "/v1/completions", key=BOB, json={"model": "echo", "prompt": "a", "n": 4})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    body = {"model": "echo", "prompt": ["a", "b"]}
    assert call(gw, "POST", "/v1/completions", key=BOB, json=body).status_code == 200
    r = call(gw, "POST", "/v1/completions", key=BOB, json=body)
    assert r.status_code == 429 and "3 requests per minute" in r.json()["error"]["message"]
    assert call(gw, "POST", "/v1/completions", key=BOB, json={"model": "echo", "prompt": "a"}).status_code == 200


def test_tokens_per_minute_count_each_choice_reading_its_prompt(gw):
    # carol: 30 tokens/min. n=2 over a 5-token prompt with 10 tokens each: 2 x (5 + 10) = 30.
    body = {"model": "echo", "prompt": "a b c d e", "max_tokens": 10, "n": 2}
    assert call(gw, "POST", "/v1/completions", key=CAROL, json=body).status_code == 200
    r = call(gw, "POST", "/v1/completions", key=CAROL, json={"model": "echo", "prompt": "a", "max_tokens": 1})
    assert r.status_code == 429 and "30 tokens per minute" in r.json()["error"]["message"]


def test_tokens_per_minute_are_reserved_up_front_and_the_unused_part_refunded():
    """A burst of requests, none finished yet, cannot all pass a budget: each is charged its
    max_tokens (at most the key's minute) when admitted; at its end, what it used instead."""
    store = KeyStore.from_config(parse_config(
        f"auth:\n  keys: [{{name: k, key: {CAROL}, tokens_per_minute: 100}}]\nmodels:\n  - name: m\n    deployments: [{{name: d, backend: echo}}]\n").auth)
    key = store.lookup(CAROL)
    limiter = KeyLimiter()
    limiter.admit(key, reserve_tokens=4096)  # charged the key's whole minute
    with pytest.raises(Exception, match="100 tokens per minute"):
        limiter.admit(key, reserve_tokens=10)
    limiter.finish(key, 30)  # used 30: 70 back
    limiter.admit(key, reserve_tokens=60)  # 30 + 60
    limiter.admit(key, reserve_tokens=20)  # under the minute when admitted: 110
    with pytest.raises(Exception, match="100 tokens per minute"):
        limiter.admit(key)
    limiter.finish(key, 0)  # failed before a token: its reservation back
    limiter.admit(key)


def test_a_chat_without_max_tokens_holds_the_token_budget_while_it_runs(gw):
    """carol: 30 tokens/min. A chat naming no max_tokens is charged the server's bound (4096,
    at most the 30) while it runs and its real usage after, so the next one passes."""
    body = {"model": "echo", "messages": [{"role": "user", "content": "a b"}]}
    r = call(gw, "POST", "/v1/chat/completions", key=CAROL, json=body)
    assert r.status_code == 200 and r.json()["usage"]["total_tokens"] < 30
    assert call(gw, "POST", "/v1/chat/completions", key=CAROL, json=body).status_code == 200


def test_a_key_at_its_limit_is_refused_before_its_body_is_parsed(gw):
    """bob: 3 requests/min. Once spent, a body that parsing would refuse (400) gets the 429:
    the key's admission comes first, so a key at its limit costs no parsing."""
    body = {"model": "echo", "prompt": "a", "max_tokens": 1}
    for _ in range(3):
        assert call(gw, "POST", "/v1/completions", key=BOB, json=body).status_code == 200
    broken = b'{"model": "echo", "prompt": [' + b"1," * 100_000 + b"]"  # not JSON: a 400 if parsed
    r = call(gw, "POST", "/v1/completions", key=BOB, content=broken, headers={"content-type": "application/json"})
    assert r.status_code == 429 and "3 requests per minute" in r.json()["error"]["message"]


@pytest.mark.parametrize("bad", [
    {"model": "echo", "prompt": "a", "temperature": 9},  # 400
    {"model": "secret-model", "prompt": "a"},  # 404: not bob's
])
def test_refused_requests_count_against_the_keys_minute(gw, bad):
    for _ in range(3):
        assert call(gw, "POST", "/v1/completions", key=BOB, json=bad).status_code in (400, 404)
    r = call(gw, "POST", "/v1/completions", key=BOB, json={"model": "echo", "prompt": "a", "max_tokens": 1})
    assert r.status_code == 429


@pytest.mark.parametrize("entry, allowed", [
    ("{name: k, key: sk-k-0123456789}", {"standard"}),  # the config's default class, no other
    ("{name: k, key: sk-k-0123456789, sla_class: batch}", {"batch"}),
    ("{name: k, key: sk-k-0123456789, sla_classes: [standard, interactive]}", {"standard", "interactive"}),
    ("{name: k, key: sk-k-0123456789, sla_classes: ['*']}", {"standard", "interactive", "batch"}),
])
def test_a_key_may_use_its_default_class_and_only_the_classes_it_opted_in_to(entry, allowed):
    """x-sla-class cannot lift a key above its default class unless the key lists the class."""
    from gateway.errors import PermissionDenied

    store = KeyStore.of(parse_config(f"auth:\n  keys: [{entry}]\nmodels:\n  - name: m\n    deployments: [{{name: d, backend: echo}}]\n"))
    key = store.lookup("sk-k-0123456789")
    for name in ("interactive", "standard", "batch"):
        if name in allowed:
            key.check_sla_class(name, "x-sla-class")
        else:
            with pytest.raises(PermissionDenied, match=f"may not use SLA class '{name}'"):
                key.check_sla_class(name, "x-sla-class")


@pytest.mark.parametrize("path,good,bad", [
    ("/v1/embeddings", {"model": "echo", "input": "a b"}, {"model": "echo", "input": "a", "dimensions": 0}),
    ("/tokenize", {"model": "echo", "prompt": "a b"}, {"model": "echo", "prompt": "a", "nonsense": 1}),
    ("/v1/messages/count_tokens", {"model": "echo", "messages": [{"role": "user", "content": "a"}]},
     {"model": "echo", "messages": "not a list"}),
])
def test_the_token_endpoints_admit_keys_before_parsing_and_count_refusals(gw, path, good, bad):
    """bob: 3 requests/min, spent here on refused bodies; then even a good one is a 429, and a
    body that could not be parsed is refused as a 429 before it is."""
    for _ in range(3):
        assert call(gw, "POST", path, key=BOB, json=bad).status_code == 400
    assert call(gw, "POST", path, key=BOB, json=good).status_code == 429
    r = call(gw, "POST", path, key=BOB, content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 429


def test_a_changed_keys_file_reloads_the_keys_and_a_bad_entry_does_not_keep_a_revoked_key(monkeypatch, tmp_path):
    """The keys file as a mounted Secret is updated in place: the gateway sees the change on its
    own (no reload, no restart). A revoked key goes even though another entry is broken; the
    broken entry is reported and is no key."""
    dave, erin = "sk-dave-0123456789", "sk-erin-0123456789"
    keys_file = tmp_path / "keys.yaml"
    keys_file.write_text(f"- {{name: dave, key: {dave}}}\n- {{name: erin, key: {erin}}}\n")
    monkeypatch.setenv("TEST_KEYS_FILE", str(keys_file))
    monkeypatch.setenv("TEST_ADMIN_KEY", ADMIN)
    config = ("auth: {keys_file_env: TEST_KEYS_FILE, keys_file_poll_s: 0.1, admin_key_env: TEST_ADMIN_KEY}\n"
              "models:\n  - name: echo\n    deployments: [{name: echo-0, backend: echo}]\n")
    body = {"model": "echo", "prompt": "a", "max_tokens": 1}
    with GatewayServer(config) as server:
        assert call(server, "POST", "/v1/completions", key=dave, json=body).status_code == 200
        keys_file.write_text(f"- {{name: erin, key: {erin}}}\n- {{name: frank, key: short}}\n")
        deadline = time.monotonic() + 20
        while call(server, "POST", "/v1/completions", key=dave, json=body).status_code != 401:
            assert time.monotonic() < deadline, "the revoked key still works"
            time.sleep(0.05)
        assert call(server, "POST", "/v1/completions", key=erin, json=body).status_code == 200
        assert call(server, "POST", "/v1/completions", key="short", json=body).status_code == 401
        problems = call(server, "GET", "/status.json", key=ADMIN).json()["key_problems"]
        assert problems == ["keys file [TEST_KEYS_FILE][1].key: String should have at least 8 characters"]


def test_embeddings_count_each_input_and_reserve_their_tokens(gw, monkeypatch):
    """Issue 40 item 9: an embeddings request runs one sequence per input: bob (3 requests a minute)
    gets one of 2 inputs, not a second; each is admitted reserving its inputs' characters (which
    bound their tokens) and refunded to its usage at the end."""
    body = {"model": "echo", "input": ["a b", "c d e"]}
    assert call(gw, "POST", "/v1/embeddings", key=BOB, json=body).status_code == 200
    r = call(gw, "POST", "/v1/embeddings", key=BOB, json=body)
    assert r.status_code == 429 and "3 requests per minute" in r.json()["error"]["message"]
    limiter, admitted = gw.state.limiter, []
    real = limiter.acquire

    async def recorded(key, weight=1, reserve_tokens=0):
        admitted.append((key.name, weight, reserve_tokens))
        await real(key, weight, reserve_tokens)
    monkeypatch.setattr(limiter, "acquire", recorded)
    assert call(gw, "POST", "/v1/embeddings", key=ALICE, json={"model": "echo", "input": ["abcd", "xyz"]}
                ).status_code == 200
    assert admitted == [("alice", 2, 7)]
