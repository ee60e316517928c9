"""Real servers on loopback for tests: a kvgate gateway run by uvicorn in a background thread."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import socket
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
import uvicorn

from gateway.app import create_app
from gateway.config import parse_config
from gateway.state import build_state


# kvgate in front of kvgate: an echo gateway, and a front gateway whose deployment is `backend:
# openai` pointing at it (`.format(base=...)` with the echo gateway's base URL).
ECHO_GATEWAY = """
models:
  - name: echo
    deployments:
      - name: echo-0
        backend: echo
"""

OPENAI_FRONT = """
models:
  - name: echo
    deployments:
      - name: upstream-0
        backend: openai
        upstream_model: echo
        settings:
          base_url: {base}/v1
          metrics: auto
          metrics_poll_s: 0.2
"""


class GatewayServer:
    """Serves a YAML config on a free loopback port until `close()`.

    Runs in this process (uvicorn in its own thread and event loop), so a test can look at the
    backend objects while talking HTTP to the real server.
    """

    def __init__(self, config_yaml: str, extra_plugins: dict | None = None, ready_timeout: float = 30,
                 span_exporter=None, host: str = "127.0.0.1", port: int = 0):
        from gateway.plugins import make_plugin_manager
        from gateway.http.slow_clients import uvicorn_options

        self.state = build_state(parse_config(config_yaml), make_plugin_manager(extra_plugins),
                                 span_exporter=span_exporter)
        config = uvicorn.Config(create_app(self.state), host=host, port=port, log_level="warning",
                                **uvicorn_options(self.state.config.server))
        self.server = uvicorn.Server(config)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        self._wait_started(ready_timeout)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        self.base_url = f"http://{host}:{self.port}"

    def _run(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.loop.run_until_complete(self.server.serve())

    def _wait_started(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("gateway did not start")
            time.sleep(0.01)

    def backend(self, deployment: str):
        return next(d.backend for d in self.state.registry.deployments() if d.name == deployment)

    def openai(self, **kw):
        import openai

        return openai.OpenAI(base_url=self.base_url + "/v1", api_key="unused", max_retries=0, **kw)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


@contextlib.contextmanager
def native_gateway(config_yaml: str, tmp_path_factory):
    """A GatewayServer whose native engines may take minutes to load, their caches (tokenizer,
    kernels) in a temporary folder unless KVGATE_CACHE_DIR names one."""
    os.environ.setdefault("KVGATE_CACHE_DIR", str(tmp_path_factory.mktemp("kvgate-cache")))
    with GatewayServer(config_yaml, ready_timeout=600) as server:
        yield server


def native_gateway_fixtures(config_yaml: str, client_timeout: float):
    """A test module's `gw` (a native gateway, one per module) and `client` (the openai client
    on it) fixtures: `gw, client = native_gateway_fixtures(CONFIG, client_timeout=300)`."""

    @pytest.fixture(scope="module")
    def gw(tmp_path_factory):
        with native_gateway(config_yaml, tmp_path_factory) as server:
            yield server

    @pytest.fixture(scope="module")
    def client(gw):
        return gw.openai(timeout=client_timeout)

    return gw, client


class AppServer:
    """Any ASGI app (an upstream a test scripts) served by uvicorn on a free loopback port, in its
    own thread and event loop, until `close()`."""

    def __init__(self, app):
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="critical"))
        self.thread = threading.Thread(target=lambda: asyncio.run(self.server.serve()), daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)
        self.base_url = f"http://127.0.0.1:{self.server.servers[0].sockets[0].getsockname()[1]}"

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_on(hosts: list[str]) -> int:
    """A TCP port free on each of `hosts` (loopback addresses that each bind their own server,
    as the pods behind one Service do). It is chosen below the kernel's ephemeral range, so no
    port-0 bind elsewhere (free_port, any client, another test run) takes it before they start."""
    import random

    for _ in range(200):
        port = random.randrange(20000, 32768)
        try:
            for host in hosts:
                with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
                    s.bind((host, port))
        except OSError:
            continue
        return port
    raise RuntimeError(f"no port free on all of {hosts}")


def start_on_a_free_port(command, attempts: int = 5, timeout: float = 10, **popen) -> tuple[subprocess.Popen, int]:
    """For a third-party server that cannot bind port 0 and say which port it got (redis-server:
    `--port 0` turns its TCP listener off): `command(port)` started on a port free a moment ago,
    returned once the child itself listens there; a child that exits first (another process took
    the port in between) is started again on another port."""
    for _ in range(attempts):
        port = free_port()
        proc = subprocess.Popen(command(port), **popen)
        if wait_listening(proc, port, timeout):
            return proc, port
    raise AssertionError(f"{command(0)[0]} exited at start {attempts} times (ports taken?)")


def wait_listening(proc: subprocess.Popen, port: int, timeout: float = 10) -> bool:
    """True once `proc` (or a process it started) listens on `port`, False if it exits first. A
    connection to the port would not do: it succeeds when someone else holds the port."""
    import psutil

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            parent = psutil.Process(proc.pid)
            family = [parent, *parent.children(recursive=True)]
            if any(c.status == psutil.CONN_LISTEN and c.laddr.port == port
                   for p in family for c in p.net_connections(kind="tcp")):
                return True
        except psutil.NoSuchProcess:
            pass
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    raise AssertionError(f"{proc.args[0]} did not listen on port {port} within {timeout} s")


UVICORN_LISTENING = re.compile(r"Uvicorn running on (http://[^ ]+:\d+)")


def listening_url(proc: subprocess.Popen, log_path, timeout: float = 60) -> str:
    """The base URL of a child server started on port 0 (`kvgate serve --port 0`, any uvicorn
    app), read from the line uvicorn logs once it listens. The child binds the port itself: a
    port picked here with free_port() and freed for the child can be taken by another process
    (another test run on a shared machine) before the child binds it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = Path(log_path).read_text(errors="replace") if Path(log_path).exists() else ""
        found = UVICORN_LISTENING.search(text)
        if found:
            return found.group(1)
        if proc.poll() is not None:
            raise AssertionError(f"server exited before listening: {text[-3000:]}")
        time.sleep(0.05)
    raise AssertionError("server did not log that it listens")


def wait_ready(base_url: str, proc: subprocess.Popen, timeout: float = 60, path: str = "/health/ready",
               log_path=None) -> None:
    """Until the child server answers 200 on `path`; its exit before that fails with its stderr
    (or the tail of `log_path`, where its output goes to a file)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited: {_exit_output(proc, log_path)}")
        try:
            if httpx.get(base_url + path, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"server did not answer 200 on {path} within {timeout} s")


def _exit_output(proc: subprocess.Popen, log_path) -> str:
    if log_path is not None:
        return Path(log_path).read_text(errors="replace")[-3000:]
    return proc.stderr.read().decode() if proc.stderr else str(proc.returncode)


def content_length(head: bytes) -> int:
    """The Content-Length of a raw HTTP/1.1 request head (0 without one): for the tests' own
    scripted servers, which read bodies byte for byte."""
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 0


class ScriptedServer:
    """A raw asyncio TCP server on loopback, in its own thread and event loop, for tests that say
    byte for byte what an upstream sends: a subclass answers each connection in `serve`. Set what
    `serve` reads before calling `__init__` (connections may come at once). `close()` ends the
    connections still served, then stops and closes the loop (a coroutine left suspended when
    the loop stops is reported as an unraisable exception when it is collected)."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        started = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(started,), daemon=True)
        self.thread.start()
        assert started.wait(10)
        self.base_url = f"http://127.0.0.1:{self.port}"

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self.server = self.loop.run_until_complete(asyncio.start_server(self.serve, "127.0.0.1", 0))
        self.port = self.server.sockets[0].getsockname()[1]
        started.set()
        self.loop.run_forever()

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        raise NotImplementedError

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._shut_down(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()

    async def _shut_down(self) -> None:
        self.server.close()
        served = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in served:
            task.cancel()
        await asyncio.gather(*served, return_exceptions=True)
