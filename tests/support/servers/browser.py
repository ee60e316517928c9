"""Headless Chromium for the status-page tests: found on the PATH (skipped without it, unless
KVGATE_REQUIRE_CHROMIUM is set), driven by its command line or, to fill in a form, through the
DevTools protocol (a websocket, with the `websockets` package uvicorn already brings)."""

from __future__ import annotations

import contextlib
import itertools
import json
import re
import shutil
import subprocess
import time

import httpx

from tests.support.checks.skips import required

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--window-size=1280,900"]


def chromium() -> str:
    """Chromium is not among what `make test` needs (Python, pip, gcc): without it the browser
    tests skip, unless KVGATE_REQUIRE_CHROMIUM is set (.ci/run installs it and sets it)."""
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        required("KVGATE_REQUIRE_CHROMIUM", "Chromium is not installed (.ci/run installs the Debian package 'chromium')")
    return path


def headless(url: str, *extra: str) -> subprocess.CompletedProcess:
    flags = [*FLAGS, "--virtual-time-budget=4000"]
    return subprocess.run([chromium(), *flags, *extra, url], capture_output=True, text=True, timeout=120)


class DevToolsPage:
    """One page of a headless Chromium, driven over the DevTools protocol."""

    def __init__(self, profile_dir: str):
        from websockets.sync.client import connect

        self.process = subprocess.Popen(
            [chromium(), *FLAGS, "--remote-debugging-port=0", f"--user-data-dir={profile_dir}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        port = self._devtools_port()
        deadline = time.monotonic() + 30
        while True:
            pages = [t for t in httpx.get(f"http://127.0.0.1:{port}/json/list").json() if t["type"] == "page"]
            if pages or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        self.stack = contextlib.ExitStack()
        self.ws = self.stack.enter_context(connect(pages[0]["webSocketDebuggerUrl"], max_size=None, open_timeout=30))
        self.ids = itertools.count(1)

    def _devtools_port(self) -> int:
        deadline = time.monotonic() + 60
        for line in self.process.stderr:  # "DevTools listening on ws://127.0.0.1:PORT/devtools/browser/..."
            found = re.search(r"DevTools listening on ws://[^:]+:(\d+)/", line)
            if found:
                return int(found.group(1))
            if time.monotonic() > deadline:
                break
        raise RuntimeError("Chromium did not open its DevTools port")

    def call(self, method: str, **params) -> dict:
        request_id = next(self.ids)
        self.ws.send(json.dumps({"id": request_id, "method": method, "params": params}))
        while True:
            message = json.loads(self.ws.recv(timeout=60))
            if message.get("id") == request_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})

    def evaluate(self, expression: str):
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout_s: float = 30):
        """Poll a JavaScript expression until it is truthy; its value."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                value = self.evaluate(expression)
            except RuntimeError:  # the page is navigating: its context is gone for a moment
                value = None
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {expression}")
            time.sleep(0.1)

    def close(self) -> None:
        try:
            self.stack.close()
        finally:
            self.process.kill()
            self.process.wait(10)
