"""A client that goes away frees what it held at once, wherever its request was: in the
admission queue, waiting for the first token, or mid-stream. Nothing leaks (queue entries, the
deployment's in-flight count, a breaker's half-open probe), the backend is told to abort, and the
request is counted as cancelled (499), not as a failure of the service.
"""

import json
import socket
import threading
import time

import httpx
import pytest

from tests.support.servers.loopback import GatewayServer

CONFIG = """
models:
  - name: one-slot
    queue: {max_size: 8, max_in_flight_per_deployment: 1}
    deployments:
      - {name: slot-0, backend: echo, settings: {tokens_per_second: 4}}
  - name: late
    breaker: {failures: 1, cooldown_s: 0.2}
    deployments:
      - {name: late-0, backend: echo, settings: {first_token_delay_s: 30}}
  - name: slow
    deployments:
      - {name: slow-0, backend: echo, settings: {tokens_per_second: 20}}
"""


@pytest.fixture()
def gw():
    with GatewayServer(CONFIG) as server:
        yield server


def send_and_hang_up(gw, model: str, *, stream: bool = False, after=lambda: True, wait_bytes: bool = False):
    """Send a request on a raw socket, wait until `after()` (or the response's first bytes),
    then close the connection as a client that gives up would."""
    body = json.dumps({"model": model, "prompt": "a b c d e f g h", "max_tokens": 8, "stream": stream}).encode()
    with socket.create_connection(("127.0.0.1", gw.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        if wait_bytes:
            sock.recv(200)
        assert wait_for(after)


def wait_for(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return False


def pool(gw, name):
    return gw.state.registry.resolve(name)


def no_leaks(gw):
    for p in gw.state.registry.pools:
        assert p.admission.queued == 0 and p.admission._heap == [], p.name
        for d in p.deployments:
            assert d.in_flight == 0 and not d.breaker.probe_in_flight, d.name


def test_clients_leaving_the_queue_free_their_places_at_once(gw):
    slot = pool(gw, "one-slot")
    occupant = threading.Thread(target=lambda: httpx.post(
        gw.base_url + "/v1/completions", json={"model": "one-slot", "prompt": "x y", "max_tokens": 20}, timeout=30))
    occupant.start()
    assert wait_for(lambda: slot.in_flight == 1)
    for _ in range(20):  # churn: far more leavers than the queue holds
        send_and_hang_up(gw, "one-slot", after=lambda: slot.admission.queued == 1)
        assert wait_for(lambda: slot.admission.queued == 0 and slot.admission._heap == [])
    assert slot.in_flight == 1  # only the occupant
    occupant.join()
    assert wait_for(lambda: slot.in_flight == 0)
    no_leaks(gw)
    status = httpx.get(gw.base_url + "/status.json").json()["requests"]
    assert status["cancelled"] == 20 and status["failed"] == 0


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_leaving_before_the_first_token_aborts_the_backend_now(gw, stream):
    backend = gw.backend("late-0")
    send_and_hang_up(gw, "late", stream=stream, after=lambda: backend.load().running == 1)
    # The backend would sleep 30 s before its first token; it is aborted as soon as the client goes.
    assert wait_for(lambda: backend.load().running == 0 and len(backend.aborted_ids) == 1)
    assert wait_for(lambda: pool(gw, "late").in_flight == 0)
    no_leaks(gw)


def test_a_half_open_probe_whose_client_leaves_is_released(gw):
    deployment = pool(gw, "late").deployments[0]
    deployment.breaker.record_failure()  # open; half-open after 0.2 s
    assert wait_for(lambda: deployment.breaker.state == "half_open")
    send_and_hang_up(gw, "late", after=lambda: deployment.breaker.probe_in_flight)
    assert wait_for(lambda: not deployment.breaker.probe_in_flight and deployment.in_flight == 0)
    assert deployment.breaker.allows()  # another probe may go


def test_a_stream_cut_by_its_client_is_cancelled_not_failed(gw):
    backend = gw.backend("slow-0")
    send_and_hang_up(gw, "slow", stream=True, wait_bytes=True)
    assert wait_for(lambda: backend.load().running == 0 and pool(gw, "slow").in_flight == 0)
    status = httpx.get(gw.base_url + "/status.json").json()
    assert status["requests"] == {"total": 1, "failed": 0, "cancelled": 1}
    assert status["recent_errors"] == []
    metrics = httpx.get(gw.base_url + "/metrics").text
    assert 'kvgate_requests_total{deployment="slow-0",model="slow",sla_class="standard",status="499"} 1.0' in metrics


@pytest.mark.parametrize("delay_ms", [0, 1, 2, 5, 10, 20, 50, 100, 200])
def test_leaving_at_any_point_of_the_request_path_leaks_nothing(gw, delay_ms):
    """Cut after various delays: during body read, routing, queueing, before and after the
    first token of a queued, slow backend."""
    slot = pool(gw, "one-slot")
    occupant = threading.Thread(target=lambda: httpx.post(
        gw.base_url + "/v1/completions", json={"model": "one-slot", "prompt": "x", "max_tokens": 1}, timeout=30))
    occupant.start()
    for stream in (False, True):
        body = json.dumps({"model": "one-slot", "prompt": "a b", "max_tokens": 3, "stream": stream}).encode()
        with socket.create_connection(("127.0.0.1", gw.port)) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            time.sleep(delay_ms / 1000)
    occupant.join()
    assert wait_for(lambda: slot.in_flight == 0 and slot.admission.queued == 0), (
        slot.in_flight, slot.admission.queued, slot.admission._heap)
    no_leaks(gw)
