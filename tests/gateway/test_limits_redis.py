"""Two real `kvgate serve` processes share one key's budget through a real redis-server, keep
serving on local limits when Redis dies, and share again when it returns."""

import os
import subprocess
import sys
import time

import httpx
import pytest

from tests.support.servers.redis_server import redis_or_skip
from tests.support.servers.loopback import listening_url, wait_ready

SECRET = "sk-shared-budget-0123"
STREAMER = "sk-streamer-key-4567"
CONFIG = """
server: {log_level: info}  # uvicorn logs the port it bound (port 0) at info
auth:
  limits_store: {kind: redis, url_env: KVGATE_TEST_REDIS_URL, timeout_s: 0.3}
  keys:
    - {name: team, key_env: KVGATE_TEST_KEY, requests_per_minute: 10, scopes: [metrics]}  # reads /status.json, /metrics
    - {name: streamer, key_env: KVGATE_TEST_KEY2, max_concurrency: 4}
models:
  - name: echo
    deployments: [{name: echo-0, backend: echo}]
  - name: slow
    deployments: [{name: slow-0, backend: echo, settings: {tokens_per_second: 20}}]
"""


@pytest.fixture
def redis():
    server = redis_or_skip()
    yield server
    server.kill()


@pytest.fixture
def gateways(tmp_path, redis):
    config = tmp_path / "c.yaml"
    config.write_text(CONFIG)
    env = {**os.environ, "KVGATE_TEST_REDIS_URL": redis.url, "KVGATE_TEST_KEY": SECRET, "KVGATE_TEST_KEY2": STREAMER}
    procs, bases = [], []
    try:
        for i in range(2):  # each binds port 0 and logs the port it got
            with open(tmp_path / f"gateway-{i}.log", "wb") as log:
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "gateway.cli", "serve", "--config", str(config), "--port", "0"],
                    env=env, stdout=log, stderr=subprocess.STDOUT))
            bases.append(listening_url(procs[-1], tmp_path / f"gateway-{i}.log"))
        for base, proc in zip(bases, procs):
            wait_ready(base, proc)
        yield bases
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


AUTH = {"Authorization": f"Bearer {SECRET}"}


def complete(base: str) -> httpx.Response:
    return httpx.post(base + "/v1/completions", headers=AUTH,
                      json={"model": "echo", "prompt": "a b", "max_tokens": 2}, timeout=30)


def statuses(bases: list[str], count: int) -> list[int]:
    """`count` requests, alternating between the gateways; refusals must be proper 429s."""
    out = []
    for i in range(count):
        r = complete(bases[i % len(bases)])
        if r.status_code == 429:
            assert r.json()["error"]["code"] == "rate_limit_exceeded"
            assert 1 <= int(r.headers["Retry-After"]) <= 60
        out.append(r.status_code)
    return out


def limits_store(base: str) -> dict:
    return httpx.get(base + "/status.json", headers=AUTH, timeout=10).json()["limits_store"]


def store_up_metric(base: str) -> str:
    lines = httpx.get(base + "/metrics", headers=AUTH, timeout=10).text.splitlines()
    return next(line for line in lines if line.startswith("kvgate_limits_store_up{"))


def wait_shared(bases: list[str], shared: bool) -> None:
    deadline = time.monotonic() + 30
    while not all(limits_store(b)["shared"] is shared for b in bases):
        assert time.monotonic() < deadline, [limits_store(b) for b in bases]
        time.sleep(0.2)


def test_exactly_ten_between_two_then_local_then_shared_again(gateways, redis):
    got = statuses(gateways, 20)
    assert got.count(200) == 10 and got.count(429) == 10
    assert all(limits_store(b)["shared"] for b in gateways)

    # A stream admitted through Redis is running when Redis dies: it finishes normally.
    body = {"model": "slow", "prompt": "a b c", "max_tokens": 20, "stream": True}
    with httpx.stream("POST", gateways[0] + "/v1/completions", headers={"Authorization": f"Bearer {STREAMER}"},
                      json=body, timeout=30) as stream:
        assert stream.status_code == 200
        lines = stream.iter_lines()
        assert next(line for line in lines if line).startswith("data: {")
        redis.kill()
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]" and not any('"error"' in line for line in rest)
    # Redis is gone: neither gateway refuses traffic for it; each counts the key alone, from an
    # empty window, so each accepts 10 more.
    for base in gateways:
        got = statuses([base], 12)
        assert got == [200] * 10 + [429] * 2
        status = limits_store(base)
        assert status["shared"] is False and "Redis unreachable" in status["problem"]
        assert store_up_metric(base).endswith(" 0.0")

    redis.start()  # an empty Redis on the same port: a fresh shared budget
    wait_shared(gateways, True)
    got = statuses(gateways, 20)
    assert got.count(200) == 10 and got.count(429) == 10
    assert all(store_up_metric(b).endswith(" 1.0") for b in gateways)
