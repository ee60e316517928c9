"""Hot reload on SIGHUP and on the admin endpoint, under load, with a real `kvgate serve` process."""

import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.servers.loopback import listening_url, wait_ready

ADMIN = "sk-admin-reload-0123"

OLD = """
auth: {admin_key_env: RELOAD_ADMIN_KEY}
models:
  - name: chat
    deployments: [{name: old-0, backend: echo, settings: {tokens_per_second: 10}}]
"""

NEW = """
auth: {admin_key_env: RELOAD_ADMIN_KEY}
models:
  - name: chat
    aliases: [chat-v2]
    deployments: [{name: new-0, backend: echo, settings: {tokens_per_second: 500}}]
  - name: extra
    deployments: [{name: extra-0, backend: echo}]
"""


@pytest.fixture()
def server(tmp_path):
    config = tmp_path / "gw.yaml"
    config.write_text(OLD)
    log_path = tmp_path / "server.log"
    log = open(log_path, "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "serve", "--config", str(config), "--port", "0"],
        env={**os.environ, "RELOAD_ADMIN_KEY": ADMIN}, stdout=log, stderr=subprocess.STDOUT,
    )
    try:
        base = listening_url(proc, log_path)
        wait_ready(base, proc)
        yield proc, base, config, log_path
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def model_ids(base):
    return sorted(m["id"] for m in httpx.get(base + "/v1/models").json()["data"])


def metric(base, name: str, **labels) -> float:
    """One sample of /metrics (0 when the series does not exist yet)."""
    text = httpx.get(base + "/metrics", headers={"authorization": f"Bearer {ADMIN}"}).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


def wait_for(predicate, timeout=10):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError("condition not reached")


def test_sighup_reload_under_load_loses_no_stream(server):
    proc, base, config, log_path = server
    client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
    results, errors = [], []

    def stream_one(i):
        try:
            chunks = client.completions.create(model="chat", prompt=f"w{i} x y z", max_tokens=20, stream=True)
            results.append("".join(c.choices[0].text for c in chunks))
        except Exception as exc:  # noqa: BLE001 - collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=stream_one, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    # Every stream under way before the reload: the pool of `chat` is old-0 alone until then, and
    # at 10 tokens/s each stream holds it for 2 s.
    wait_for(lambda: metric(base, "kvgate_in_flight_requests", model="chat") == 12)
    config.write_text(NEW)
    proc.send_signal(signal.SIGHUP)
    wait_for(lambda: model_ids(base) == ["chat", "extra"])
    # new requests use the new config while the old streams are still running
    assert client.completions.create(model="chat-v2", prompt="p q", max_tokens=2).choices[0].text == "p q"
    for t in threads:
        t.join(timeout=60)
    assert errors == []
    assert len(results) == 12
    assert sorted(results) == sorted(" ".join(([f"w{i}", "x", "y", "z"] * 5)) for i in range(12))
    # ... and old-0 served all of them: the new deployment answers the same echo text, so the
    # text alone cannot tell a stream that survived the reload from one that started after it.
    assert metric(base, "kvgate_requests_total", deployment="old-0", status="200") == 12
    assert metric(base, "kvgate_requests_total", deployment="new-0", status="200") == 1
    wait_for(lambda: "retired deployment old-0 of model chat stopped" in log_path.read_text())


def test_invalid_new_config_is_refused_and_the_old_one_keeps_serving(server):
    proc, base, config, log_path = server
    config.write_text(OLD.replace("  - name: chat\n", "  - name: chat\n    colour: red\n"))
    proc.send_signal(signal.SIGHUP)
    wait_for(lambda: "config reload refused" in log_path.read_text())
    assert "models[0].colour: unknown key" in log_path.read_text()
    assert model_ids(base) == ["chat"]
    r = httpx.post(base + "/v1/completions", json={"model": "chat", "prompt": "still here", "max_tokens": 2})
    assert r.json()["choices"][0]["text"] == "still here"


def test_admin_endpoint_reloads_and_reports_errors(server):
    proc, base, config, log_path = server
    auth = {"authorization": f"Bearer {ADMIN}"}
    config.write_text("models: [")
    bad = httpx.post(base + "/admin/reload", headers=auth)
    assert bad.status_code == 400
    assert "not valid YAML" in bad.json()["error"]["message"]
    config.write_text(NEW)
    good = httpx.post(base + "/admin/reload", headers=auth)
    assert good.status_code == 200 and good.json()["reloaded"] is True
    assert model_ids(base) == ["chat", "extra"]
    assert httpx.post(base + "/admin/reload").status_code == 401
