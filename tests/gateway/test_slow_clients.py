"""Slow clients (slowloris) against a real gateway on loopback: a head or a body trickled a
byte at a time is cut off at its deadline while the gateway serves everyone else, and
connections past the cap are closed at once."""

import socket
import threading
import time

import httpx
import pytest

from tests.support.servers.loopback import GatewayServer

CONFIG = """
server:
  connections: {head_timeout_s: 1, body_timeout_s: 1, max_connections: 6}
models:
  - name: echo
    deployments: [{name: echo-0, backend: echo}]
"""
BODY = b'{"model": "echo", "prompt": "a b", "max_tokens": 2}'
LIMIT_S = 15  # far past the 1 s deadlines: only a server that never cuts the client reaches it


@pytest.fixture(scope="module")
def gw():
    with GatewayServer(CONFIG) as server:
        yield server


def trickle(sock: socket.socket, data: bytes, gap_s: float = 0.1) -> bytes:
    """Send `data` (over and over) a byte every gap_s until the server closes the connection;
    what it answered."""
    sock.settimeout(gap_s)
    started, answer = time.monotonic(), b""
    try:
        for i in range(len(data) * 100):
            assert time.monotonic() - started < LIMIT_S, f"still open after {LIMIT_S} s"
            try:
                sock.sendall(data[i % len(data):i % len(data) + 1])
                chunk = sock.recv(65536)
            except socket.timeout:
                continue
            except OSError:  # reset by the server: closed
                break
            if not chunk:
                break
            answer += chunk
        return answer
    finally:
        sock.close()


def served(gw) -> bool:
    r = httpx.post(gw.base_url + "/v1/completions", content=BODY, headers={"content-type": "application/json"},
                   timeout=10)
    return r.status_code == 200


def test_a_trickled_head_is_cut_off_while_others_are_served(gw):
    head = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n" + b"x-pad: " + b"a" * 200
    results = {}
    sock = socket.create_connection(("127.0.0.1", gw.port))
    thread = threading.Thread(target=lambda: results.update(out=trickle(sock, head)))
    thread.start()
    time.sleep(0.3)
    assert served(gw)  # while the trickle is on
    thread.join()
    answer = results["out"]
    assert answer.startswith(b"HTTP/1.1 408") and b"head did not arrive within 1 s" in answer


def test_a_trickled_body_is_cut_off_while_others_are_served(gw):
    head = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n" % (len(BODY) * 10))
    sock = socket.create_connection(("127.0.0.1", gw.port))
    sock.sendall(head)
    results = {}
    thread = threading.Thread(target=lambda: results.update(out=trickle(sock, BODY * 10)))
    thread.start()
    time.sleep(0.3)
    assert served(gw)
    thread.join()
    answer = results["out"]
    assert answer.startswith(b"HTTP/1.1 408") and b"body did not arrive within 1 s" in answer
    assert served(gw)


def test_connections_past_the_cap_are_closed_and_the_rest_served(gw):
    held = [socket.create_connection(("127.0.0.1", gw.port)) for _ in range(6)]
    try:
        extra = socket.create_connection(("127.0.0.1", gw.port))
        extra.settimeout(LIMIT_S)
        assert extra.recv(1) == b""  # closed at once, before its head deadline could
        extra.close()
    finally:
        for s in held:
            s.close()
    deadline = time.monotonic() + LIMIT_S
    while not served(gw):  # the held ones are gone once the server has seen them close
        assert time.monotonic() < deadline
        time.sleep(0.05)
