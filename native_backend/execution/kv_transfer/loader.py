"""A consumer's reads of producers' blocks, each on a thread of the loader's pool. Into this
process's cache they are written as they arrive, on that thread (`blocks.receive_blocks`): a 4k-token
prompt's ~180 MiB copied inside the step loop stalled every running stream for ~0.1-0.4 s. Under
tensor parallelism (no `receive`: the workers' shards go on the step pipes) a read fills a staging
buffer that the step loop writes (`KVConnectorWorker.commit`) when it takes the result.
"""

from __future__ import annotations

import hashlib
import hmac
import queue
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from native_backend.core.kv_params import KVLoad
from native_backend.execution.kv_transfer.trust import ProducerAllowList, payload_mac
from native_backend.execution.kv_transfer.wire import recv_exact, recv_header, send_header

LOAD_THREADS = 4


@dataclass
class LoadOutcome:
    """One read's end (core.kv_connector.LoadResult)."""

    load: KVLoad
    ok: bool
    error: str | None = None
    nbytes: int = 0
    seconds: float = 0.0
    payload: bytearray | None = None  # staged bytes the step loop writes; None once in the blocks


class KVBlockLoader:
    def __init__(self, layout: dict, block_bytes: int, timeout_s: float, receive=None, *,
                 allowed: ProducerAllowList | None = None, key: bytes = b"", header_timeout_s: float = 2.0):
        """`receive(local_block_ids, next_part)`: writes a payload into the cache as it is read
        (blocks.LocalBlocks.receive); None: the payload is staged for the step loop. `allowed`: the
        producers it connects to (None: loopback alone); `key`: the engines' shared secret."""
        self.allowed = allowed if allowed is not None else ProducerAllowList(["127.0.0.0/8", "::1"])
        self.key = key
        self.header_timeout_s = min(header_timeout_s, timeout_s)
        self.layout = layout
        self.block_bytes = block_bytes
        self.receive = receive
        self.timeout_s = timeout_s  # without progress, a read fails (and its prompt is recomputed)
        self._pool = ThreadPoolExecutor(LOAD_THREADS, thread_name_prefix="kvgate-kv-load")
        self._done: queue.SimpleQueue[LoadOutcome] = queue.SimpleQueue()
        self._ended = threading.Event()

    def start(self, load: KVLoad) -> None:
        self._pool.submit(self._run, load)

    def take_finished(self) -> list[LoadOutcome]:
        finished = []
        while not self._done.empty():
            finished.append(self._done.get_nowait())
        return finished

    def wait(self, timeout: float) -> None:
        if self._ended.wait(timeout):
            self._ended.clear()

    def _run(self, load: KVLoad) -> None:
        started = time.monotonic()
        try:
            nbytes, payload = self._fetch(load)
            outcome = LoadOutcome(load, True, nbytes=nbytes, payload=payload)
        except Exception as exc:  # noqa: BLE001 - whatever broke the read, the prompt is recomputed
            outcome = LoadOutcome(load, False, error=f"{type(exc).__name__}: {exc}")
        outcome.seconds = time.monotonic() - started
        self._done.put(outcome)
        self._ended.set()

    def _fetch(self, load: KVLoad) -> tuple[int, bytearray | None]:
        """(bytes read, the staged payload or None when written in place). Raises (the prompt is
        recomputed) for a producer not on the allow-list, one that does not answer within the
        header timeout, a refusal, and a payload whose MAC is not the engines' key's."""
        source = load.source
        address = self.allowed.address(source.host, source.port)
        with socket.create_connection((address, source.port), timeout=self.header_timeout_s) as sock:
            send_header(sock, dict(engine_id=source.engine_id, request_id=source.request_id,
                                   block_ids=load.remote_block_ids, first_block=load.first_block,
                                   block_hashes=[h.hex() for h in load.block_hashes], layout=self.layout))
            answer = recv_header(sock)
            if not answer.get("ok"):
                raise PermissionError(f"the producer refused: {answer.get('error')}")
            sock.settimeout(self.timeout_s)
            expected = len(load.remote_block_ids) * self.block_bytes
            if answer.get("nbytes") != expected:
                raise ValueError(f"the producer announced {answer.get('nbytes')} bytes, not {expected}")
            digest = hashlib.sha256()

            def next_part(nbytes: int) -> bytearray:
                part = recv_exact(sock, nbytes)
                digest.update(part)
                return part

            payload = next_part(expected) if self.receive is None else None
            if payload is None:
                self.receive(load.local_block_ids, next_part)
            self._check_mac(recv_header(sock), load, digest.digest())
            return expected, payload

    def _check_mac(self, trailer: dict, load: KVLoad, digest: bytes) -> None:
        source = load.source
        mac = payload_mac(self.key, source.engine_id, source.request_id, load.block_hashes, digest)
        if not hmac.compare_digest(str(trailer.get("mac", "")), mac):
            raise PermissionError("the payload's MAC is not the engines' key's (another key, or forged bytes)")
