"""What the native plugin's fault tests check of a live gateway: raw SSE streams and how a cut one
ends, readiness, and waiting for a condition."""

from __future__ import annotations

import json
import time

import httpx


def stream_lines(gw, **body):
    """A raw SSE stream (what a client sees byte for byte): its data lines, as they come."""
    body = {"model": "smollm2", "prompt": "Count slowly:", "max_tokens": 2000, "ignore_eos": True,
            "temperature": 0, "stream": True, **body}
    with httpx.stream("POST", gw.base_url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                yield line[6:]


def ends_with_one_error_then_done(lines) -> str:
    """Consume a stream that is cut: some chunks, exactly one error event, then [DONE]. Returns
    the error's message."""
    errors, tail = [], []
    for line in lines:
        tail.append(line)
        if line != "[DONE]" and "error" in json.loads(line):
            errors.append(json.loads(line)["error"])
    assert tail[-1] == "[DONE]" and len(errors) == 1, tail[-3:]
    assert json.loads(tail[-2]) == {"error": errors[0]}
    return errors[0]["message"]


def wait_until(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def ready(gw) -> bool:
    return httpx.get(gw.base_url + "/health/ready").status_code == 200
