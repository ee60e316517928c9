"""POST /v1/completions and /v1/chat/completions skip Starlette's middleware stack and router
(gateway.http.hot_routes.HotRoutes); their errors must be answered exactly as Starlette answered them,
and no middleware may sit in the skipped stack.

Each case runs twice on a real server: through HotRoutes, and with HotRoutes passing every
request on to Starlette (the way these routes were served before), and both answers must match.
"""

import logging

import httpx
import pytest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.gzip import GZipMiddleware

from gateway.api import generate as api
from gateway.app import create_app
from gateway.config import parse_config
from gateway.errors import RateLimited
from gateway.http.hot_routes import HotRoutes, skipped_layers
from gateway.state import build_state
from tests.support.servers.loopback import GatewayServer

CONFIG = """
models:
  - name: echo
    deployments:
      - name: echo-0
        backend: echo
        settings: {tokens_per_second: 2000}
"""
UNEXPECTED = "The server had an error while processing the request."


@pytest.fixture(params=["hot routes", "starlette"])
def gw(request, monkeypatch):
    if request.param == "starlette":
        async def through_starlette(self, scope, receive, send):
            await self.app(scope, receive, send)
        monkeypatch.setattr(HotRoutes, "__call__", through_starlette)
    with GatewayServer(CONFIG) as server:
        yield server


def post(gw, path="/v1/completions", **body):
    body = {"model": "echo", "max_tokens": 4, **body}
    if "messages" not in body:
        body.setdefault("prompt", "a b c")
    return httpx.post(gw.base_url + path, json=body, timeout=30)


def test_answers_and_refusals_are_unchanged(gw):
    r = post(gw)
    assert r.status_code == 200 and r.json()["object"] == "text_completion"
    chat = post(gw, "/v1/chat/completions", messages=[{"role": "user", "content": "hi"}])
    assert chat.status_code == 200 and chat.json()["object"] == "chat.completion"
    unknown = post(gw, model="nope")
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    bad = httpx.post(gw.base_url + "/v1/completions", content=b"{not json", timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
    wrong_method = httpx.get(gw.base_url + "/v1/completions", timeout=30)
    assert wrong_method.status_code == 405 and "error" in wrong_method.json()


def test_an_api_error_raised_by_the_endpoint_keeps_its_status_and_headers(gw, monkeypatch):
    async def refuse(request, parse, id_prefix):
        raise RateLimited("Slow down.", retry_after_s=2)
    monkeypatch.setattr(api, "_serve", refuse)
    r = post(gw)
    assert r.status_code == 429 and r.json()["error"]["message"] == "Slow down."
    assert r.headers["retry-after"] == "2"


def test_an_unexpected_error_is_a_logged_500_in_the_openai_shape(gw, monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise ZeroDivisionError("a bug")
    monkeypatch.setattr(api, "full_body", broken)
    with caplog.at_level(logging.ERROR, logger="kvgate.app"):
        r = post(gw)
    assert r.status_code == 500
    assert r.json()["error"]["message"] == UNEXPECTED
    assert any("unhandled error on POST /v1/completions" in m for m in caplog.messages)
    assert post(gw).status_code == 500 and gw.server.started  # the server goes on serving


def test_an_unexpected_error_mid_stream_ends_the_stream_without_done(gw, monkeypatch, caplog):
    calls = []

    def breaks_on_second_chunk(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise ZeroDivisionError("a bug")
        return original(*args, **kwargs)
    original = api.stream_chunk
    monkeypatch.setattr(api, "stream_chunk", breaks_on_second_chunk)
    with caplog.at_level(logging.ERROR, logger="kvgate.app"):
        with pytest.raises(httpx.RemoteProtocolError):
            with httpx.stream("POST", gw.base_url + "/v1/completions", timeout=30,
                              json={"model": "echo", "prompt": "a b c", "max_tokens": 4, "stream": True}) as r:
                assert r.status_code == 200
                for _ in r.iter_lines():  # cut off mid-stream: no [DONE], no end of the chunked body
                    pass
    assert any("unhandled error on POST /v1/completions" in m for m in caplog.messages)
    monkeypatch.setattr(api, "stream_chunk", original)
    assert post(gw).status_code == 200


# -- what the hot path skips -------------------------------------------------------------------

def _hot_routes_of(app) -> HotRoutes:
    """The HotRoutes inside the pure-ASGI layers create_app wraps around it."""
    while not isinstance(app, HotRoutes):
        app = app.app
    return app


def test_the_gateway_app_has_no_middleware_the_hot_routes_would_skip():
    """Fails when middleware is added to the Starlette app that gateway.app builds: it would see
    every route but the two busiest. Request-wide behaviour goes around the whole app."""
    hot = _hot_routes_of(create_app(build_state(parse_config(CONFIG))))
    assert skipped_layers(hot.app) == []
    assert set(hot.endpoints) == {"/v1/completions", "/v1/chat/completions"}


async def _error(request, exc):
    raise AssertionError("not called")


@pytest.mark.parametrize("build", [
    lambda: Starlette(middleware=[Middleware(GZipMiddleware)], exception_handlers={Exception: _error}),
    lambda: Starlette(max_body_size=1024, exception_handlers={Exception: _error}),
], ids=["user middleware", "max_body_size"])
def test_hot_routes_refuse_an_app_whose_middleware_they_would_skip(build):
    with pytest.raises(RuntimeError, match="HotRoutes would skip (GZipMiddleware|RequestBodyLimitMiddleware)"):
        HotRoutes(build(), {"/v1/completions": api.completions})


def test_hot_routes_take_their_error_handlers_from_the_app():
    async def by_status(request, exc):
        return "by status"

    class Refusal(RateLimited):
        pass

    app = Starlette(exception_handlers={RateLimited: _error, 418: by_status, Exception: _error})
    hot = HotRoutes(app, {"/v1/completions": api.completions})
    assert hot.handler_of(Refusal("Slow down.")) is _error  # by class, its nearest base
    assert hot.handler_of(HTTPException(418)) is by_status
    assert hot.handler_of(HTTPException(404)).__name__ == "http_exception"  # Starlette's own
    assert hot.handler_of(ZeroDivisionError()) is None and hot.unexpected is _error
    with pytest.raises(RuntimeError, match="handler for Exception"):
        HotRoutes(Starlette(), {"/v1/completions": api.completions})
    with pytest.raises(RuntimeError, match="the one for 418 is not async"):
        HotRoutes(Starlette(exception_handlers={418: lambda request, exc: None, Exception: _error}),
                  {"/v1/completions": api.completions})
