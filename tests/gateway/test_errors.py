"""Every bad input gets an OpenAI-style error with the right status, and hurts no other request."""

import socket
import threading
import time

import httpx
import openai
import pytest

from tests.support.servers.loopback import GatewayServer

CONFIG = """
server:
  limits:
    max_body_bytes: 2000
    max_tokens: 100
    max_n: 4
    max_stop: 2
    max_top_logprobs: 5
    max_messages: 3
models:
  - name: echo
    deployments:
      - name: echo-0
        backend: echo
        settings: {max_context: 50}
  - name: slow
    deployments:
      - name: slow-0
        backend: echo
        settings: {tokens_per_second: 200}
  - name: broken
    deployments:
      - name: broken-0
        backend: echo
        settings: {fail_after_tokens: 3, tokens_per_second: 500}
  - name: stalls
    deployments:
      - name: stalls-0
        backend: echo
        settings: {stall_after_tokens: 2}
  - name: down
    deployments:
      - name: down-0
        backend: echo
        settings: {refuse_at_start: true}
"""

MSG = [{"role": "user", "content": "one two three"}]


@pytest.fixture(scope="module")
def gw():
    with GatewayServer(CONFIG) as server:
        yield server


@pytest.fixture(scope="module")
def client(gw):
    return gw.openai()


def post(gw, path, **kw):
    return httpx.post(gw.base_url + path, timeout=10, **kw)


def assert_error(response, status, code, param=None, type_="invalid_request_error"):
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["code"], error["param"]) == (type_, code, param)
    for leak in ("Traceback", 'File "', ".py", "site-packages"):
        assert leak not in error["message"]
    return error


def test_malformed_json(gw):
    assert_error(post(gw, "/v1/chat/completions", content=b"{nope"), 400, "invalid_value")


def test_body_must_be_an_object(gw):
    assert_error(post(gw, "/v1/completions", json=[1, 2]), 400, "invalid_value")


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": 3}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"n": 0}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"stream": "yes"}, "stream"),
        ({"seed": 1.5}, "seed"),
        ({"stop": [1]}, "stop"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user"}]}, "messages[0]"),
        ({"top_logprobs": 2}, None),
    ],
)
def test_wrong_types_and_values(gw, extra, param):
    body = {"model": "echo", "messages": MSG, **extra}
    assert_error(post(gw, "/v1/chat/completions", json=body), 400, "invalid_value", param)


def test_missing_required_parameter(gw):
    assert_error(post(gw, "/v1/completions", json={"model": "echo"}), 400, "missing_required_parameter", "prompt")


def test_unknown_parameter_is_rejected(gw):
    body = {"model": "echo", "messages": MSG, "temprature": 0.5}
    err = assert_error(post(gw, "/v1/chat/completions", json=body), 400, "unknown_parameter", "temprature")
    assert "Unrecognized request argument" in err["message"]


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"logit_bias": {"1": 5}}, "logit_bias"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
    ],
)
def test_unsupported_parameters_are_rejected(gw, extra, param):
    response = post(gw, "/v1/chat/completions", json={"model": "echo", "messages": MSG, **extra})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == param


def test_completion_echo_is_unsupported(gw):
    body = {"model": "echo", "prompt": "a", "echo": True}
    assert_error(post(gw, "/v1/completions", json=body), 400, "unsupported_parameter", "echo")


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"max_tokens": 101}, "max_tokens"),
        ({"n": 5}, "n"),
        ({"stop": ["a", "b", "c"]}, "stop"),
        ({"logprobs": True, "top_logprobs": 6}, "logprobs"),
        ({"messages": MSG * 4}, "messages"),
    ],
)
def test_server_limits(gw, extra, param):
    body = {"model": "echo", "messages": MSG, **extra}
    assert_error(post(gw, "/v1/chat/completions", json=body), 400, "invalid_value", param)


def test_unknown_model_is_404_through_the_client(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-9", messages=MSG)
    assert info.value.body["code"] == "model_not_found"
    assert info.value.body["param"] == "model"


def test_context_length_exceeded(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="echo", prompt="w " * 45, max_tokens=10)
    assert info.value.body["code"] == "context_length_exceeded"
    assert "50" in info.value.body["message"]


def test_body_over_limit_by_content_length(gw):
    big = {"model": "echo", "prompt": "x" * 5000}
    assert_error(post(gw, "/v1/completions", json=big), 413, "request_too_large")


def test_chunked_body_over_limit_is_cut_off(gw):
    def chunks():
        yield b'{"model": "echo", "prompt": "'
        for _ in range(100):
            yield b"x" * 100
        yield b'"}'

    assert_error(post(gw, "/v1/completions", content=chunks()), 413, "request_too_large")


def test_wrong_route_and_wrong_method(gw):
    assert_error(httpx.get(gw.base_url + "/v1/nothing"), 404, "not_found")
    assert_error(httpx.get(gw.base_url + "/v1/chat/completions"), 405, "method_not_allowed")


def test_backend_that_failed_to_start_gives_503_and_not_ready(gw, client):
    with pytest.raises(openai.InternalServerError) as info:
        client.completions.create(model="down", prompt="a b")
    assert info.value.status_code == 503
    assert info.value.body["code"] == "server_is_overloaded"
    assert info.value.response.headers["retry-after"]
    ready = httpx.get(gw.base_url + "/health/ready")
    assert ready.status_code == 503
    assert "refuses to start" in ready.json()["deployments"]["down-0"]


def test_failure_mid_stream_is_one_error_event(gw, client):
    stream = client.completions.create(model="broken", prompt="a b c d e", max_tokens=10, stream=True)
    received = []
    with pytest.raises(openai.APIError) as info:
        for chunk in stream:
            received.append(chunk.choices[0].text)
    assert "".join(received) == "a b c"
    assert "broken-0" in str(info.value)
    with httpx.stream("POST", gw.base_url + "/v1/completions",
                      json={"model": "broken", "prompt": "a b c d", "max_tokens": 10, "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-2].startswith('data: {"error"') and lines[-1] == "data: [DONE]"


def test_failure_before_first_token_is_502(gw):
    backend = gw.backend("broken-0")
    backend.settings = backend.settings.model_copy(update={"fail_after_tokens": 0})
    try:
        r = post(gw, "/v1/completions", json={"model": "broken", "prompt": "a b", "max_tokens": 3})
        assert_error(r, 502, "upstream_error", type_="server_error")
    finally:
        backend.settings = backend.settings.model_copy(update={"fail_after_tokens": 3})


def test_a_failing_request_does_not_disturb_others(gw, client):
    results = {}

    def healthy_stream():
        chunks = client.completions.create(model="slow", prompt="p q r s", max_tokens=40, stream=True)
        results["text"] = "".join(c.choices[0].text for c in chunks)

    worker = threading.Thread(target=healthy_stream)
    worker.start()
    for _ in range(5):
        with pytest.raises(openai.APIError):
            list(client.completions.create(model="broken", prompt="a b c d", max_tokens=10, stream=True))
        assert_error(post(gw, "/v1/completions", content=b"{"), 400, "invalid_value")
    worker.join(timeout=30)
    assert results["text"] == " ".join(("p q r s " * 10).split())


def _open_stream_and_hang_up(gw, body: bytes) -> None:
    with socket.create_connection(("127.0.0.1", gw.port)) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode() + body
        )
        sock.recv(200)  # the response has started


def wait_for(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def test_client_disconnect_mid_stream_aborts_the_backend(gw):
    backend = gw.backend("stalls-0")
    before = len(backend.aborted_ids)
    _open_stream_and_hang_up(gw, b'{"model": "stalls", "prompt": "a b c d", "max_tokens": 10, "stream": true}')
    assert wait_for(lambda: len(backend.aborted_ids) > before)
    assert wait_for(lambda: backend.load().running == 0)


def test_client_disconnect_while_waiting_non_streaming_aborts(gw):
    backend = gw.backend("stalls-0")
    before = len(backend.aborted_ids)
    body = b'{"model": "stalls", "prompt": "a b c d", "max_tokens": 10}'
    with socket.create_connection(("127.0.0.1", gw.port)) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode() + body
        )
        assert wait_for(lambda: backend.load().running == 1)
    assert wait_for(lambda: len(backend.aborted_ids) > before)
    assert wait_for(lambda: backend.load().running == 0)
