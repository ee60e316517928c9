"""The status page, loaded in headless Chromium against a running gateway with live traffic."""

import os
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.support.servers.browser import chromium, headless
from tests.support.servers.loopback import GatewayServer

ROOT = Path(__file__).resolve().parents[2]
CONFIG = """
models:
  - name: chat-model
    deployments:
      - {name: fast-0, backend: echo, settings: {tokens_per_second: 200}}
      - {name: broken-0, backend: echo, settings: {refuse_at_start: true}}
"""


@pytest.fixture(scope="module")
def gw():
    with GatewayServer(CONFIG) as server:
        yield server


def traffic(gw, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        httpx.post(gw.base_url + "/v1/completions", json={"model": "chat-model", "prompt": "a b c", "max_tokens": 4})
        httpx.post(gw.base_url + "/v1/completions", json={"model": "chat-model", "prompt": "", "max_tokens": 4})


def test_status_json_has_the_live_numbers(gw):
    traffic(gw, 0.3)
    s = httpx.get(gw.base_url + "/status.json").json()
    [model] = s["models"]
    deployments = {d["name"]: d for d in model["deployments"]}
    assert deployments["fast-0"]["up"] and not deployments["broken-0"]["up"]
    assert "refuses to start" in deployments["broken-0"]["start_error"]
    assert s["requests"]["total"] > 0 and s["requests"]["failed"] > 0
    assert s["latency"]["ttft_p50"] > 0 and s["latency"]["tpot_p50"] > 0
    assert s["recent_errors"][0]["status"] == 400
    assert [c["name"] for c in s["sla_classes"]] == ["interactive", "standard", "batch"]


def test_root_redirects_to_the_page(gw):
    r = httpx.get(gw.base_url + "/", follow_redirects=False)
    assert r.status_code in (302, 307) and r.headers["location"] == "/status"
    assert "<title>kvgate status</title>" in httpx.get(gw.base_url + "/status").text


def test_page_in_headless_chromium_shows_live_numbers(gw, tmp_path):
    chromium()  # skips before any traffic starts when there is no browser
    worker = threading.Thread(target=traffic, args=(gw, 3.0))
    worker.start()
    dom = headless(gw.base_url + "/status", f"--user-data-dir={tmp_path / 'profile-a'}", "--dump-dom").stdout
    worker.join()
    assert 'data-deployment="fast-0"' in dom and 'data-deployment="broken-0"' in dom
    assert "refuses to start" in dom
    total = dom.split('id="total-requests">')[1].split("<")[0]
    assert int(total) > 0
    ttft = dom.split('id="ttft-p50">')[1].split("<")[0]
    assert ttft.endswith(" ms")
    assert "<polyline" in dom  # sparklines drawn from successive polls
    # The README's picture is refreshed on request only, so a test run leaves the tree unchanged.
    shot = ROOT / "bench" / "results" / "status_page.png" if os.environ.get("KVGATE_UPDATE_SCREENSHOTS") else tmp_path / "status.png"
    worker = threading.Thread(target=traffic, args=(gw, 4.0))
    worker.start()
    headless(gw.base_url + "/status", f"--user-data-dir={tmp_path / 'profile-b'}", f"--screenshot={shot}")
    worker.join()
    assert shot.stat().st_size > 10_000
