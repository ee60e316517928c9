"""The native engine at tensor_parallel_size 3 (SmolLM2, fp32, gloo on CPU) behind a real gateway.

Greedy completions through the openai client are token-identical to transformers'. Faults: a
worker SIGKILLed or SIGSTOPped mid-stream fails the in-flight stream with one error event naming
the rank (the stopped one through the collective timeout, not the 60 s watchdog), readiness drops,
the supervisor restarts the engine, and no process of the old group is left; SIGTERM to a real
`kvgate serve` leaves no engine or worker process behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from native_backend.model.loader import default_gguf_path
from native_backend.text.tokenizer import Tokenizer
from tests.support.servers.loopback import GatewayServer, listening_url
from tests.support.checks.stream_checks import ends_with_one_error_then_done, ready, stream_lines, wait_until
from tests.support.checks.tensor_parallel_checks import smollm2_prompts, transformers_greedy

pytestmark = pytest.mark.timeout(1800)

NEW_TOKENS = 32
SETTINGS = ("{tensor_parallel_size: 3, num_threads: 1, kv_cache_bytes: 67108864, max_num_seqs: 8, "
            "collective_timeout_s: 5, supervision: {watchdog_s: 60, backoff_s: 0.2, max_deaths: 5, window_s: 600}}")
CONFIG = f"""
models:
  - name: smollm2
    breaker: {{failures: 50, cooldown_s: 1}}
    deployments:
      - name: native-tp3
        backend: native
        settings: {SETTINGS}
"""


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    os.environ.setdefault("KVGATE_CACHE_DIR", str(tmp_path_factory.mktemp("kvgate-cache")))
    with GatewayServer(CONFIG, ready_timeout=900) as server:
        yield server


def group(gw) -> tuple[psutil.Process, list[psutil.Process]]:
    """The engine process (rank 0) and its two workers."""
    engine = psutil.Process(gw.backend("native-tp3").client.pid)
    workers = [p for p in engine.children() if "spawn_main" in " ".join(p.cmdline())]  # not its resource tracker
    assert len(workers) == 2, [p.cmdline() for p in engine.children()]
    return engine, workers


def gone(process: psutil.Process) -> bool:
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_greedy_completions_over_http_are_token_identical_to_transformers(gw, tmp_path):
    tokenizer = Tokenizer.from_pretrained(default_gguf_path(), cache_dir=tmp_path)
    prompts = smollm2_prompts(tokenizer)
    client = gw.openai(timeout=300)
    got = [client.completions.create(model="smollm2", prompt=p, max_tokens=NEW_TOKENS, temperature=0,
                                     extra_body={"ignore_eos": True}) for p in prompts]
    reference = transformers_greedy(prompts, NEW_TOKENS)
    for out, tokens in zip(got, reference):
        assert out.usage.completion_tokens == NEW_TOKENS
        assert out.choices[0].text == tokenizer.decode(tokens)


@pytest.mark.parametrize("sig, cause", [(signal.SIGKILL, "rank 2 was killed by SIGKILL"),
                                        (signal.SIGSTOP, "within 5 s (collective timeout): rank 2 is stopped")])
def test_a_dead_or_stopped_worker_fails_the_stream_and_the_engine_comes_back(gw, sig, cause):
    backend = gw.backend("native-tp3")
    restarts = backend.supervisor.restarts
    engine, workers = group(gw)
    lines = stream_lines(gw, max_tokens=2000)
    next(lines)  # streaming
    signalled = time.monotonic()
    os.kill(workers[1].pid, sig)
    message = ends_with_one_error_then_done(lines)
    assert "native-tp3" in message
    failed_after = time.monotonic() - signalled
    wait_until(lambda: backend.supervisor.restarts > restarts, 30, "the supervisor to restart the engine")
    assert cause in backend.supervisor.last_cause
    assert not ready(gw) or backend.supervisor.state == "up"
    wait_until(lambda: all(gone(p) for p in (engine, *workers)), 30, "the old group's processes to end")
    wait_until(lambda: ready(gw), 900, "the restarted engine")
    answer = gw.openai(timeout=120).completions.create(model="smollm2", prompt="Hello", max_tokens=2)
    assert answer.usage.completion_tokens == 2
    print(f"{sig.name}: stream failed {failed_after:.1f} s after the signal")


def test_sigterm_of_the_gateway_leaves_no_engine_or_worker_behind(tmp_path):
    config = tmp_path / "kvgate.yaml"
    config.write_text(CONFIG)
    env = {**os.environ, "KVGATE_CACHE_DIR": os.environ.get("KVGATE_CACHE_DIR", str(tmp_path / "cache"))}
    log_path = tmp_path / "gateway.log"
    with open(log_path, "wb") as log:  # the child binds port 0 and logs the port it got
        proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "--config", str(config), "--host",
                                 "127.0.0.1", "--port", "0"], cwd=Path(__file__).parents[2], env=env,
                                stdout=log, stderr=subprocess.STDOUT)
    try:
        base = listening_url(proc, log_path, timeout=900)
        wait_until(lambda: _ready(base) or proc.poll() is not None, 900, "the gateway")
        assert proc.poll() is None, log_path.read_text(errors="replace")[-3000:]
        descendants = psutil.Process(proc.pid).children(recursive=True)
        assert sum("spawn_main" in " ".join(p.cmdline()) for p in descendants) >= 3  # engine + 2 workers
        proc.send_signal(signal.SIGTERM)
        # uvicorn re-raises the signal once drained: -15 here, 143 in a container
        assert proc.wait(timeout=120) in (0, -signal.SIGTERM)
        wait_until(lambda: all(gone(p) for p in descendants), 30, "every engine and worker process to end")
    finally:
        if proc.poll() is None:
            proc.kill()


def _ready(base: str) -> bool:
    try:
        return httpx.get(f"{base}/health/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
