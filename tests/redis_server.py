"""A real redis-server on a loopback port for tests (Debian's package; tests skip without it)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time

from servers import free_port
from skips import required

BINARY = shutil.which("redis-server")


def redis_or_skip() -> "RedisServer":
    if BINARY is None:  # CI installs it and sets KVGATE_REQUIRE_REDIS: a skip there would hide a failure
        required("KVGATE_REQUIRE_REDIS", "redis-server is not installed (apt-get install redis-server)")
    return RedisServer()


class RedisServer:
    """An empty, persistence-free Redis; `kill()` and `start()` again on the same port."""

    def __init__(self, port: int | None = None):
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [BINARY, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                if self.proc.poll() is not None:
                    raise RuntimeError("redis-server exited at start")
                time.sleep(0.05)
        raise RuntimeError("redis-server did not listen")

    def kill(self) -> None:
        """SIGKILL: Redis vanishes the way a crashed pod does, with every count it held."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
        if self.proc:
            self.proc.wait()
