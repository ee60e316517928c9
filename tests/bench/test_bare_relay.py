"""bench/bare_relay.py, the floor target of bench/upstream_overhead.py (--relay): it must pass
the upstream's answers through unchanged, or the floor it reports is of something else."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.support.servers.loopback import listening_url, wait_ready

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _serve(log_path: Path, *args) -> tuple[subprocess.Popen, str]:
    """A bench server on a port it binds itself (port 0), and its base URL from its log."""
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, *map(str, args)], stdout=log, stderr=subprocess.STDOUT)
    return proc, listening_url(proc, log_path)


@pytest.fixture(scope="module")
def upstream_and_relay(tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    procs = []
    try:
        upstream_proc, upstream = _serve(logs / "upstream.log", BENCH / "bare_server.py", 0, 5)
        procs.append(upstream_proc)
        wait_ready(upstream, upstream_proc)
        relay_proc, relay = _serve(logs / "relay.log", BENCH / "bare_relay.py", 0, upstream)
        procs.append(relay_proc)
        wait_ready(relay, relay_proc)
        yield upstream, relay
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=30)


@pytest.mark.parametrize("stream", [False, True])
def test_the_relay_answers_exactly_what_the_upstream_answers(upstream_and_relay, stream):
    body = {"model": "echo", "prompt": "hello", "max_tokens": 5, "stream": stream}
    answers = [httpx.post(base + "/v1/completions", json=body, timeout=10) for base in upstream_and_relay]
    assert [a.status_code for a in answers] == [200, 200]
    assert answers[0].content == answers[1].content
    assert answers[0].headers["content-type"] == answers[1].headers["content-type"]
    if stream:
        assert answers[1].content.count(b"data: ") == 6 and answers[1].content.endswith(b"data: [DONE]\n\n")
