"""Tenancy of the operator pages with keys on: /metrics, /status and /status.json are for the
admin key (or a key with the metrics scope); other keys see only their models; a browser signs
in with the admin key through a form that sets an HttpOnly, SameSite=Strict session cookie."""

import httpx
import pytest

from tests.support.servers.browser import DevToolsPage, chromium
from gateway.config import ConfigError, parse_config
from gateway.keys import sessions
from tests.support.servers.loopback import GatewayServer

ALICE, BOB, MONITOR = "sk-alice-0123456789", "sk-bob-0123456789", "sk-monitor-0123456789"
ADMIN = "sk-admin-0123456789"
BROWSER = {"accept": "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"}

CONFIG = f"""
auth:
  admin_key_env: TEST_ADMIN_KEY
  keys:
    - {{name: alice, key: {ALICE}, models: [echo]}}
    - {{name: bob, key: {BOB}, models: [secret-model]}}
    - {{name: monitor, key: {MONITOR}, models: [echo], scopes: [metrics]}}
models:
  - name: echo
    deployments: [{{name: echo-0, backend: echo}}]
  - name: secret-model
    deployments: [{{name: secret-0, backend: echo}}]
"""


@pytest.fixture(scope="module")
def gw():
    mp = pytest.MonkeyPatch()
    mp.setenv("TEST_ADMIN_KEY", ADMIN)
    with GatewayServer(CONFIG) as server:
        # one failure on each model, for the "recent errors" each view may see
        for key, model in ((ALICE, "echo"), (BOB, "secret-model")):
            httpx.post(server.base_url + "/v1/completions", headers=_bearer(key),
                       json={"model": model, "prompt": "", "max_tokens": 2}, timeout=10)
        yield server
    mp.undo()


def _bearer(key):
    return {"authorization": f"Bearer {key}"}


def get(gw, path, key=None, **kw):
    headers = {**(_bearer(key) if key else {}), **kw.pop("headers", {})}
    return httpx.get(gw.base_url + path, headers=headers, timeout=10, follow_redirects=False, **kw)


def test_metrics_are_for_the_admin_and_metrics_scoped_keys(gw):
    assert get(gw, "/metrics").status_code == 401
    refused = get(gw, "/metrics", ALICE)
    assert refused.status_code == 403 and refused.json()["error"]["type"] == "permission_error"
    assert "metrics scope" in refused.json()["error"]["message"]
    for key in (MONITOR, ADMIN):
        r = get(gw, "/metrics", key)
        assert r.status_code == 200 and 'model="secret-model"' in r.text


def test_a_client_key_sees_only_its_models_on_the_status(gw):
    mine = get(gw, "/status.json", ALICE).json()
    assert [m["name"] for m in mine["models"]] == ["echo"] and mine["view"] == "key"
    assert {e["model"] for e in mine["recent_errors"]} == {"echo"}
    assert "requests" not in mine and "latency" not in mine  # every tenant's traffic
    for key in (MONITOR, ADMIN):
        everything = get(gw, "/status.json", key).json()
        assert [m["name"] for m in everything["models"]] == ["echo", "secret-model"]
        assert {e["model"] for e in everything["recent_errors"]} == {"echo", "secret-model"}
        assert everything["requests"]["failed"] >= 2


def test_admin_key_is_not_a_client_key(gw):
    r = httpx.post(gw.base_url + "/v1/completions", headers=_bearer(ADMIN), json={"model": "echo", "prompt": "a"})
    assert r.status_code == 401


def test_browser_without_a_session_gets_the_sign_in_form(gw):
    r = get(gw, "/status", headers=BROWSER)
    assert r.status_code == 401 and 'action="/status/login"' in r.text and 'name="key"' in r.text
    assert get(gw, "/status").json()["error"]["type"] == "authentication_error"  # an API client: JSON


def sign_in(gw, key):
    return httpx.post(gw.base_url + "/status/login", data={"key": key}, timeout=10, follow_redirects=False)


def test_sign_in_sets_a_strict_http_only_cookie_that_opens_only_the_operator_pages(gw, caplog):
    wrong = sign_in(gw, ALICE)  # a client key is not the admin key
    assert wrong.status_code == 401 and "That is not the admin key." in wrong.text
    assert "set-cookie" not in wrong.headers
    assert "sign-in with a wrong key from 127.0.0.1" in caplog.text and ALICE not in caplog.text
    r = sign_in(gw, ADMIN)
    assert r.status_code == 303 and r.headers["location"] == "/status"
    cookie = r.headers["set-cookie"]
    attributes = {a.strip().split("=")[0].lower() for a in cookie.split(";")[1:]}
    assert {"httponly", "path", "max-age", "samesite"} <= attributes and "SameSite=Strict" in cookie
    value = cookie.split(";")[0].split("=", 1)[1]
    assert ADMIN not in cookie and "admin" not in value
    session = {"cookie": f"{sessions.COOKIE}={value}"}
    assert get(gw, "/status.json", headers=session).json()["requests"]["total"] >= 2
    assert get(gw, "/metrics", headers=session).status_code == 200
    assert "<title>kvgate status</title>" in get(gw, "/status", headers={**session, **BROWSER}).text
    # the cookie is for reading the operator pages, nothing else
    api = httpx.post(gw.base_url + "/v1/completions", headers=session, json={"model": "echo", "prompt": "a"})
    assert api.status_code == 401
    assert httpx.post(gw.base_url + "/admin/reload", headers=session).status_code == 401
    forged = {"cookie": f"{sessions.COOKIE}={value[:-1]}{'0' if value[-1] != '0' else '1'}"}
    assert get(gw, "/status.json", headers=forged).status_code == 401
    out = httpx.post(gw.base_url + "/status/logout", headers=session, follow_redirects=False)
    assert out.status_code == 303 and "Max-Age=0" in out.headers["set-cookie"]


def test_an_unknown_scope_is_a_config_error():
    text = "auth:\n  keys: [{name: k, key: sk-k-0123456789, scopes: [admin]}]\nmodels:\n  - name: m\n" \
           "    deployments: [{name: d, backend: echo}]\n"
    with pytest.raises(ConfigError) as info:
        parse_config(text)
    assert any(p.startswith("auth.keys[0].scopes[0]: Input should be 'metrics'") for p in info.value.problems), \
        info.value.problems


def test_sessions_expire_and_die_with_the_admin_key():
    secret = b"s" * 32
    cookie = sessions.issue(secret, now=1000.0)
    assert sessions.valid(cookie, secret, now=1000.0 + sessions.TTL_S - 1)
    assert not sessions.valid(cookie, secret, now=1000.0 + sessions.TTL_S + 1)
    assert not sessions.valid(cookie, b"t" * 32, now=1000.0)  # another admin key
    assert not sessions.valid("garbage", secret) and not sessions.valid(None, secret)


def test_status_page_sign_in_in_headless_chromium(gw, tmp_path):
    chromium()  # skips without the browser (fails instead where KVGATE_REQUIRE_CHROMIUM is set)
    page = DevToolsPage(str(tmp_path / "profile"))
    try:
        page.call("Page.navigate", url=gw.base_url + "/status")
        page.wait_for("document.querySelector('form#login') !== null")
        assert page.evaluate("document.getElementById('total-requests')") is None  # no numbers yet
        # a wrong key: the form again, with the reason
        page.evaluate(f"document.getElementById('key').value = {ALICE!r}; document.getElementById('login').submit()")
        assert "That is not the admin key." in page.wait_for("document.getElementById('message')?.textContent")
        # the admin key: the live page, its numbers read from /status.json with the session cookie
        page.evaluate(f"document.getElementById('key').value = {ADMIN!r}; document.getElementById('login').submit()")
        total = page.wait_for("(t => t && /^[0-9]+$/.test(t.textContent) && t.textContent)"
                              "(document.getElementById('total-requests'))")
        assert int(total) >= 2
        assert page.evaluate("location.pathname") == "/status"
        assert page.wait_for("document.querySelector('[data-deployment=\"secret-0\"]') !== null")
        [cookie] = page.call("Network.getCookies", urls=[gw.base_url])["cookies"]
        assert cookie["name"] == sessions.COOKIE and cookie["httpOnly"] and cookie["sameSite"] == "Strict"
        assert page.evaluate("document.cookie") == ""  # no script on the page can read it
        page.call("Network.clearBrowserCookies")  # the session ends (expired, or a new admin key)
        page.wait_for("document.querySelector('form#login') !== null")  # the page asks to sign in again
    finally:
        page.close()


@pytest.mark.parametrize("value", ["²" * 3 + ".x.y", "9" * 5000 + ".x.y", "1.2", "١٢٣.abc.def", "..", "x" * 300])
def test_a_malformed_session_cookie_is_a_401_not_a_500(gw, value):
    r = get(gw, "/status.json", headers={"cookie": f"{sessions.COOKIE}={value}".encode()})
    assert r.status_code == 401, r.text


def test_sign_out_revokes_the_session(gw):
    value = sign_in(gw, ADMIN).headers["set-cookie"].split(";")[0].split("=", 1)[1]
    session = {"cookie": f"{sessions.COOKIE}={value}"}
    assert get(gw, "/status.json", headers=session).status_code == 200
    assert httpx.post(gw.base_url + "/status/logout", headers=session, follow_redirects=False).status_code == 303
    assert get(gw, "/status.json", headers=session).status_code == 401  # a copy of the cookie is dead too


def own_gateway(monkeypatch, server: str = ""):
    monkeypatch.setenv("TEST_ADMIN_KEY", ADMIN)
    return GatewayServer(server + CONFIG)


def test_repeated_wrong_keys_are_throttled(monkeypatch):
    with own_gateway(monkeypatch) as gw:
        for _ in range(5):
            assert sign_in(gw, "sk-guess-0123456789").status_code == 401
        r = sign_in(gw, ADMIN)  # even the right key waits now: the guesser cannot tell
        assert r.status_code == 429 and 1 <= int(r.headers["retry-after"]) <= 60


@pytest.mark.parametrize("server,secure", [
    ("server: {trusted_proxies: [127.0.0.1/32]}\n", True),  # the ingress that terminated TLS
    ("", False),  # anyone else's X-Forwarded-Proto is ignored (uvicorn's default believed loopback)
])
def test_the_cookie_is_secure_behind_a_trusted_tls_proxy(monkeypatch, server, secure):
    with own_gateway(monkeypatch, server) as gw:
        r = httpx.post(gw.base_url + "/status/login", data={"key": ADMIN}, headers={"x-forwarded-proto": "https"},
                       follow_redirects=False)
        assert r.status_code == 303
        assert ("; Secure" in r.headers["set-cookie"]) is secure


def test_a_short_admin_key_is_refused(monkeypatch):
    from gateway.keys.store import KeyStore

    monkeypatch.setenv("TEST_ADMIN_KEY", "short-key")
    with pytest.raises(ValueError, match="the admin key is shorter than 16 characters"):
        KeyStore.of(parse_config(CONFIG))


def test_a_tenant_sees_its_models_health_and_its_own_errors_only(gw):
    before = get(gw, "/status.json", ALICE).json()["recent_errors"]
    # another key fails on the same model: its message is not alice's to read
    httpx.post(gw.base_url + "/v1/completions", headers=_bearer(MONITOR),
               json={"model": "echo", "prompt": "", "max_tokens": 2, "user": "monitor-secret"}, timeout=10)
    mine = get(gw, "/status.json", ALICE).json()
    assert mine["recent_errors"] == before and all("key" not in e for e in mine["recent_errors"])
    [model] = mine["models"]
    assert set(model) == {"name", "aliases", "up", "deployments_up", "in_flight", "queued"}  # no deployment
    assert model["up"] is True and "echo-0" not in str(mine)  # names, addresses, problems, URLs
    everything = get(gw, "/status.json", ADMIN).json()
    assert {e["key"] for e in everything["recent_errors"]} >= {"alice", "bob", "monitor"}
    assert everything["models"][0]["deployments"][0]["name"] == "echo-0"


def test_a_flood_of_addresses_does_not_reset_a_guessers_throttle():
    now = [1000.0]
    book = sessions.SessionBook(clock=lambda: now[0])
    others = [f"10.{i >> 16}.{(i >> 8) & 255}.{i & 255}" for i in range(20_000)]
    for address in others[:9_990]:  # the book fills up with one wrong key each
        book.failed(address)
    for _ in range(sessions.MAX_FAILURES):
        book.failed("203.0.113.7")
    for address in others[9_990:]:  # 10,010 more: past the issue's 10,000, twice over
        now[0] += 0.001
        book.failed(address)
    assert book.wait_s("203.0.113.7") > 0  # the guesser still waits
    assert len(book.failures) + len(book.throttled) <= 10_001  # and the book stays bounded: the oldest went
    assert others[0] not in book.failures and others[-1] in book.failures
