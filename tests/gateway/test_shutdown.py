"""A stream still running when the shutdown timeout runs out ends with an error event, not a cut."""

import json
import signal
import subprocess
import sys
import threading

import httpx

from tests.support.servers.loopback import listening_url, wait_ready

CONFIG = """
server: {shutdown_timeout_s: 1}
models:
  - name: slow
    deployments: [{name: slow-0, backend: echo, settings: {tokens_per_second: 5}}]
"""


def test_stream_cut_by_shutdown_gets_an_error_event_and_done(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text(CONFIG)
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "--config", str(config), "--port", "0"],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        base = listening_url(proc, tmp_path / "server.log")
        wait_ready(base, proc)
        lines: list[str] = []
        started = threading.Event()

        def stream():
            body = {"model": "slow", "prompt": "a b c", "max_tokens": 100, "stream": True}
            with httpx.stream("POST", base + "/v1/completions", json=body, timeout=30) as r:
                for line in r.iter_lines():
                    if line:
                        lines.append(line)
                        started.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert started.wait(10)
        proc.send_signal(signal.SIGTERM)
        reader.join(timeout=20)
        assert not reader.is_alive()
        assert lines[-1] == "data: [DONE]"
        error = json.loads(lines[-2].removeprefix("data: "))["error"]
        assert error["code"] == "server_is_overloaded"
        assert "shutting down" in error["message"]
        assert len(lines) < 30  # it really was cut early, not run to its 100 tokens
        proc.wait(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        log.close()
