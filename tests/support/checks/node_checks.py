"""A headless node of an engine across machines (`kvgate engine --headless --node-rank 1`) as its own
process group, for the multi-node tests: its log lines read as they come, its rank processes found,
the whole node killed at once."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading

SECRET = "s3cret-shared-by-both-nodes"
START_S = 300  # the safety net of a wait for an event; the tests assert what happened, not how fast


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Node:
    """`kvgate engine --headless` as its own process group (killed whole), its log lines read as they come."""

    def __init__(self, port: int, secret: str = SECRET):
        env = dict(os.environ, KVGATE_RENDEZVOUS_SECRET=secret)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", "engine", "--headless", "--nnodes", "2", "--node-rank", "1",
             "--master-addr", "127.0.0.1", "--master-port", str(port)],
            env=env, stderr=subprocess.PIPE, text=True, start_new_session=True)
        self.lines: list[str] = []
        self._seen = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            with self._seen:
                self.lines.append(line)
                self._seen.notify_all()

    def wait_for(self, words: str) -> str:
        with self._seen:
            found = self._seen.wait_for(lambda: any(words in line for line in self.lines), START_S)
        assert found, f"node 1 never said {words!r}: {''.join(self.lines)[-2000:]}"
        return next(line for line in self.lines if words in line)

    def rank_pids(self) -> list[int]:
        """The node's rank processes (spawned by its agent; not multiprocessing's resource tracker)."""
        with open(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children") as f:
            children = [int(p) for p in f.read().split()]
        return [p for p in children if b"spawn_main" in _cmdline(p)]

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()

    def count(self, words: str) -> int:
        with self._seen:
            return sum(words in line for line in self.lines)


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""
