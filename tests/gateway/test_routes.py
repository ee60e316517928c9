"""gateway/api/routes.py: each endpoint is declared once, and the router, the auth middleware, the
hot routes, the Anthropic-error paths and the OpenAPI document all read it from there."""

import httpx
import pytest
from starlette.responses import JSONResponse

from gateway.api import openapi, routes
from gateway.app import create_app
from gateway.config import parse_config
from gateway.http.routes import ADMIN, OPEN, Endpoint, access_by_path
from gateway.state import build_state
from tests.support.servers.loopback import AppServer

CONFIG = """
auth:
  admin_key_env: KVGATE_TEST_ROUTES_ADMIN
  keys: [{name: alice, key_env: KVGATE_TEST_ROUTES_ALICE}]
models:
  - name: m
    deployments: [{name: d, backend: echo}]
"""
ADMIN_KEY, ALICE = "admin-key-for-the-routes-test", "sk-alice-routes-0123456789"


@pytest.fixture
def keys(monkeypatch):
    monkeypatch.setenv("KVGATE_TEST_ROUTES_ADMIN", ADMIN_KEY)
    monkeypatch.setenv("KVGATE_TEST_ROUTES_ALICE", ALICE)


def test_each_path_is_declared_once_and_the_known_facts_hold():
    paths = [e.path for e in routes.ENDPOINTS]
    assert len(paths) == len(set(paths))
    # Literals from the docs: the hot path (docs/design/hot-path.md), Anthropic's API, the probes.
    assert {e.path for e in routes.ENDPOINTS if e.hot} == {"/v1/completions", "/v1/chat/completions"}
    assert {e.path for e in routes.ENDPOINTS if e.errors == "anthropic"} == {"/v1/messages", "/v1/messages/count_tokens"}
    assert {e.path for e in routes.ENDPOINTS if e.access == OPEN} == {"/health", "/health/live", "/health/ready",
                                                                      "/version"}
    assert {e.path for e in routes.ENDPOINTS if e.access == ADMIN} == {
        "/admin/reload", "/admin/reset_prefix_cache", "/v1/load_lora_adapter", "/v1/unload_lora_adapter"}
    with pytest.raises(ValueError, match="declared twice"):
        access_by_path(routes.ENDPOINTS + routes.ENDPOINTS[:1])


async def _extra(request):
    if request.query_params.get("fail"):
        from gateway.errors import InvalidRequestError

        raise InvalidRequestError("extra refused")
    return JSONResponse({"extra": True})


def test_a_new_endpoint_declared_in_the_table_reaches_every_consumer(keys, monkeypatch):
    """One line in the table: routed, open without a key (auth), its errors in Anthropic's shape,
    on the hot route (POST past Starlette's router) and in the OpenAPI document."""
    extra = Endpoint("/v1/extra", ("POST",), _extra, access=OPEN, hot=True, errors="anthropic",
                     openapi=openapi.summary_entry("An extra endpoint"))
    monkeypatch.setattr(routes, "ENDPOINTS", routes.ENDPOINTS + (extra,))
    app = create_app(build_state(parse_config(CONFIG)))
    assert app.app.app.app.endpoints["/v1/extra"] is _extra  # AnthropicErrors > BodyLimit > Auth > HotRoutes
    with AppServer(app) as server:
        ok = httpx.post(server.base_url + "/v1/extra")  # no key: OPEN
        assert ok.status_code == 200 and ok.json() == {"extra": True}
        refused = httpx.post(server.base_url + "/v1/extra", params={"fail": 1})
        assert refused.status_code == 400
        assert refused.json() == {"type": "error", "error": {"type": "invalid_request_error", "message": "extra refused"}}
        document = httpx.get(server.base_url + "/openapi.json", headers={"authorization": f"Bearer {ALICE}"}).json()
        assert document["paths"]["/v1/extra"]["post"]["summary"] == "An extra endpoint"


def test_without_the_declaration_the_path_is_unknown_and_needs_a_key(keys):
    app = create_app(build_state(parse_config(CONFIG)))
    with AppServer(app) as server:
        assert httpx.post(server.base_url + "/v1/extra").status_code == 401  # a key first, then a 404
        r = httpx.post(server.base_url + "/v1/extra", headers={"authorization": f"Bearer {ALICE}"})
        assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"
        document = httpx.get(server.base_url + "/openapi.json", headers={"authorization": f"Bearer {ALICE}"}).json()
        assert "/v1/extra" not in document["paths"]
        # echo serves every generation and token endpoint (its capabilities): all are documented
        assert set(document["paths"]) == {e.path for e in routes.ENDPOINTS if e.openapi is not None}
