"""POST /v1/completions and /v1/chat/completions skip Starlette's middleware stack and router
(gateway.app.HotRoutes); their errors must be answered exactly as Starlette answered them.

Each case runs twice on a real server: through HotRoutes, and with HotRoutes passing every
request on to Starlette (the way these routes were served before), and both answers must match.
"""

import logging

import httpx
import pytest

from gateway import api
from gateway.app import HotRoutes
from gateway.errors import RateLimited
from servers import GatewayServer

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
