"""bench/bare_relay.py, the floor target of bench/upstream_overhead.py (--relay): it must pass
the upstream's answers through unchanged, or the floor it reports is of something else."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from servers import free_port, wait_ready

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _serve(*args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, *map(str, args)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


@pytest.fixture(scope="module")
def upstream_and_relay():
    up_port, relay_port = free_port(), free_port()
    upstream = f"http://127.0.0.1:{up_port}"
    procs = [_serve(BENCH / "bare_server.py", up_port, 5)]
    try:
        wait_ready(upstream, procs[0])
        procs.append(_serve(BENCH / "bare_relay.py", relay_port, upstream))
        wait_ready(f"http://127.0.0.1:{relay_port}", procs[1])
        yield upstream, f"http://127.0.0.1:{relay_port}"
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
