"""Failover before the first token, fallback models, timeouts and the circuit breaker."""

import httpx
import openai
import pytest

from kvgate_echo import reply_pieces
from tests.support.servers.loopback import GatewayServer

CONFIG = """
models:
  - name: flaky
    policy: round_robin
    breaker: {failures: 2, cooldown_s: 0.4}
    deployments:
      - {name: bad, backend: echo, settings: {fail_after_tokens: 0}}
      - {name: good, backend: echo}
  - name: all-bad
    fallback: backup
    timeouts: {first_token_s: 0.3}
    deployments:
      - {name: bad-1, backend: echo, settings: {fail_after_tokens: 0}}
      - {name: stall-1, backend: echo, settings: {stall_after_tokens: 0}}
  - name: backup
    deployments:
      - {name: backup-0, backend: echo}
  - name: no-fallback
    timeouts: {first_token_s: 0.3}
    deployments:
      - {name: stall-2, backend: echo, settings: {stall_after_tokens: 0}}
  - name: midstream
    timeouts: {idle_s: 0.3}
    deployments:
      - {name: stall-mid, backend: echo, settings: {stall_after_tokens: 2}}
"""

PROMPT = "alpha beta gamma delta"


def expected(n):
    return "".join(p for _, p in reply_pieces(PROMPT.split(), 0, n, ())[0])


@pytest.fixture()
def gw():
    with GatewayServer(CONFIG) as server:
        yield server


class ManualClock:
    """The breaker's clock, moved only by the test: its cool-down passes when the test says so,
    never because a loaded machine took 0.4 s over a few requests."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def breaker_of(gw, deployment: str) -> tuple:
    breaker = next(d for d in gw.state.registry.deployments() if d.name == deployment).breaker
    breaker.clock = clock = ManualClock()
    return breaker, clock


def count_calls(backend):
    calls = []
    original = backend.generate

    def spy(request):
        calls.append(request.request_id)
        return original(request)

    backend.generate = spy
    return calls


def test_failure_before_first_token_fails_over_without_duplicates(gw):
    client = gw.openai()
    bad_calls = count_calls(gw.backend("bad"))
    for _ in range(2):
        out = client.completions.create(model="flaky", prompt=PROMPT, max_tokens=6)
        assert out.choices[0].text == expected(6)
        chunks = list(client.completions.create(model="flaky", prompt=PROMPT, max_tokens=6, stream=True))
        assert "".join(c.choices[0].text for c in chunks) == expected(6)
    assert bad_calls  # the broken deployment really was tried first


def test_breaker_opens_then_probes_back_in(gw):
    client = gw.openai()
    bad = gw.backend("bad")
    bad_calls = count_calls(bad)
    breaker, clock = breaker_of(gw, "bad")
    while breaker.state != "open":
        client.completions.create(model="flaky", prompt=PROMPT, max_tokens=2)
    tried = len(bad_calls)
    for _ in range(6):
        client.completions.create(model="flaky", prompt=PROMPT, max_tokens=2)
    assert len(bad_calls) == tried  # out of rotation while open
    assert breaker.state == "open"
    clock.advance(0.5)  # the cool-down (0.4 s) has passed
    assert breaker.state == "half_open"
    bad.settings = bad.settings.model_copy(update={"fail_after_tokens": None})  # it recovered
    for _ in range(4):
        assert client.completions.create(model="flaky", prompt=PROMPT, max_tokens=2).choices[0].text == expected(2)
    assert breaker.state == "closed"
    assert len(bad_calls) > tried  # the probe went through and it is back in rotation


def test_failed_probe_reopens_the_breaker(gw):
    client = gw.openai()
    breaker, clock = breaker_of(gw, "bad")
    while breaker.state != "open":
        client.completions.create(model="flaky", prompt=PROMPT, max_tokens=2)
    opened = breaker.times_opened
    clock.advance(0.5)
    for _ in range(3):
        client.completions.create(model="flaky", prompt=PROMPT, max_tokens=2)
    assert breaker.state == "open"
    assert breaker.times_opened == opened + 1


def test_every_deployment_failing_moves_to_the_fallback_model(gw):
    client = gw.openai()
    out = client.completions.create(model="all-bad", prompt=PROMPT, max_tokens=5)
    assert out.choices[0].text == expected(5)
    stall = gw.backend("stall-1")
    assert stall.aborted_ids  # the stalled attempt was aborted, not left running
    chunks = list(client.chat.completions.create(
        model="all-bad", messages=[{"role": "user", "content": PROMPT}], max_tokens=3, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected(3)


def test_first_token_timeout_without_fallback_is_504(gw):
    r = httpx.post(gw.base_url + "/v1/completions", json={"model": "no-fallback", "prompt": "a b"}, timeout=10)
    assert r.status_code == 504
    assert r.json()["error"]["code"] == "timeout"
    assert "0.3 s" in r.json()["error"]["message"]


def test_idle_timeout_mid_stream_ends_with_one_error_event(gw):
    client = gw.openai()
    received = []
    with pytest.raises(openai.APIError) as info:
        for chunk in client.completions.create(model="midstream", prompt=PROMPT, max_tokens=8, stream=True):
            received.append(chunk.choices[0].text)
    assert "".join(received) == expected(2)
    assert "sent nothing for 0.3 s" in str(info.value)
    with httpx.stream("POST", gw.base_url + "/v1/completions",
                      json={"model": "midstream", "prompt": PROMPT, "max_tokens": 8, "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-2].startswith('data: {"error"') and lines[-1] == "data: [DONE]"
    assert sum(line.startswith('data: {"error"') for line in lines) == 1
