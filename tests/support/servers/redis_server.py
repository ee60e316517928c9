"""A real redis-server on a loopback port for tests (Debian's package; tests skip without it)."""

from __future__ import annotations

import shutil
import subprocess

from tests.support.servers.loopback import start_on_a_free_port, wait_listening
from tests.support.checks.skips import required

BINARY = shutil.which("redis-server")


def redis_or_skip() -> "RedisServer":
    if BINARY is None:  # CI installs it and sets KVGATE_REQUIRE_REDIS: a skip there would hide a failure
        required("KVGATE_REQUIRE_REDIS", "redis-server is not installed (apt-get install redis-server)")
    return RedisServer()


class RedisServer:
    """An empty, persistence-free Redis; `kill()` and `start()` again on the same port."""

    def __init__(self):
        # redis-server cannot bind port 0 and report it (--port 0 turns TCP off): a free port,
        # tried again on another if the server exits at start because someone took it first.
        self.proc, self.port = start_on_a_free_port(self.command, stdout=subprocess.DEVNULL,
                                                    stderr=subprocess.DEVNULL)
        self.url = f"redis://127.0.0.1:{self.port}/0"

    @staticmethod
    def command(port: int) -> list[str]:
        return [BINARY, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]

    def start(self) -> None:
        """Again, on the port it had (what a restarted Redis pod does)."""
        self.proc = subprocess.Popen(self.command(self.port), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if not wait_listening(self.proc, self.port):
            raise RuntimeError(f"redis-server exited at its restart on port {self.port} (taken meanwhile?)")

    def kill(self) -> None:
        """SIGKILL: Redis vanishes the way a crashed pod does, with every count it held."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
        if self.proc:
            self.proc.wait()
