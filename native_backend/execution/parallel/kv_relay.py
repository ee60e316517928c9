"""Prefill/decode disaggregation under tensor parallelism: every rank's KV blocks as one payload,
moved through rank 0 (execution.kv_transfer sends and reads it over TCP as it would one rank's).

Each rank holds its own KV heads of every block (the same block ids on every rank), so a
producer of TP N and a consumer of TP N move shard r to rank r:

    payload = rank 0's blocks.read_blocks bytes, then rank 1's, ..., rank N-1's
    layout  = {tensor_parallel_size: N, ranks: [each rank's blocks.layout()]}
              (dtype, heads, fp8 scales and the digest of its key offsets: each rank's heads' own)

    producer: the server's thread reads rank 0's shard itself, then asks each worker for its
              shard over the worker's KV pipe (a thread of the worker answers it, beside its
              step loop: held blocks are never rewritten), and sends it on;
    consumer: the read lands whole in rank 0's staging buffer; the commit (the step loop, between
              steps) writes rank 0's shard and sends each worker its shard on the step pipe,
              ahead of the next step that reads those blocks.

A consumer of another TP size is refused by the producer (the layouts differ) and recomputes.
A rank that cannot give its shard (its pipe broken, no answer within RELAY_TIMEOUT_S) breaks
the whole send: the consumer receives fewer bytes than announced and recomputes the prompt, so
a partial KV is never committed. Bytes pass through rank 0's process: one connection per read,
whatever N (per-rank connections would spread the copy; not done).
"""

from __future__ import annotations

import logging
import threading
from multiprocessing.connection import Connection

from native_backend.execution.kv_transfer.blocks import LocalBlocks, block_bytes, read_blocks, write_blocks
from native_backend.model.kv_cache import KVCache

log = logging.getLogger("kvgate.kv_transfer")
RELAY_TIMEOUT_S = 30.0  # a worker that has not answered a shard read this long fails the read


# ------------------------------------------------------------------------------ a worker's side


def serve_shard_reads(cache: KVCache, conn: Connection) -> None:
    """A worker's thread: answer rank 0's reads of held blocks, [block ids] -> ("ok", n) and n
    buffers, or ("error", why). Ends when rank 0 closes the pipe."""
    while True:
        try:
            block_ids = conn.recv()
        except (EOFError, OSError):
            return
        try:
            buffers = list(read_blocks(cache, block_ids))
        except Exception as exc:  # noqa: BLE001 - rank 0 fails that read; the next one may work
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
            continue
        conn.send(("ok", len(buffers)))
        for buffer in buffers:  # flat: send_bytes would take a (blocks, ...) view's len for its size
            conn.send_bytes(memoryview(buffer).cast("B"))


def start_shard_server(cache: KVCache, conn: Connection) -> None:
    threading.Thread(target=serve_shard_reads, args=(cache, conn), name="kvgate-kv-shard", daemon=True).start()


def write_shard(cache: KVCache, conn: Connection, block_ids: list[int]) -> None:
    """A worker's step loop, on ("kv_write", block_ids): the shard's bytes follow on the pipe."""
    payload = bytearray(len(block_ids) * block_bytes(cache))
    conn.recv_bytes_into(payload)
    write_blocks(cache, block_ids, payload)


# ------------------------------------------------------------------------------ rank 0's side


class ShardRefused(OSError):
    """A worker answered that it could not read its shard: that read fails, the pipe stays in step."""


class ShardPipe:
    """Rank 0's end of one worker's KV pipe: one read at a time; out of step after a failure."""

    def __init__(self, rank: int, conn: Connection, shard_bytes: int):
        self.rank = rank
        self.conn = conn
        self.block_bytes = shard_bytes  # this rank's bytes of one block
        self._lock = threading.Lock()
        self._broken: str | None = None  # a read that failed midway leaves the pipe out of step

    def read(self, block_ids: list[int]) -> list[bytes]:
        """The rank's shard of `block_ids`; ConnectionError / TimeoutError when it cannot give it."""
        with self._lock:
            if self._broken is not None:
                raise ConnectionError(f"rank {self.rank}'s KV pipe is out of order ({self._broken})")
            try:
                return self._read(block_ids)
            except ShardRefused:
                raise
            except (EOFError, OSError) as exc:
                self._broken = f"{type(exc).__name__}: {exc}"
                raise ConnectionError(f"rank {self.rank} did not give its KV shard: {self._broken}") from None

    def _read(self, block_ids: list[int]) -> list[bytes]:
        self.conn.send(block_ids)
        status = self._next(self.conn.recv)
        if status[0] != "ok":
            raise ShardRefused(f"rank {self.rank} could not read its KV shard: {status[1]}")
        buffers = [self._next(self.conn.recv_bytes) for _ in range(status[1])]
        got, expected = sum(len(b) for b in buffers), len(block_ids) * self.block_bytes
        if got != expected:
            raise ConnectionError(f"{got} bytes, not {expected}")
        return buffers

    def _next(self, receive):
        if not self.conn.poll(RELAY_TIMEOUT_S):
            raise TimeoutError(f"no answer within {RELAY_TIMEOUT_S:g} s")
        return receive()

    def close(self) -> None:
        self.conn.close()


class TensorParallelBlocks:
    """Every rank's blocks as one payload (the module's docstring), behind the same four members
    as blocks.LocalBlocks, for the KV connector: tp_size, block_bytes, layout(), read(), write()."""

    def __init__(self, rank0: KVCache, pipes: list[ShardPipe], worker_layouts: list[dict],
                 send_write):
        """`pipes`: ranks 1..N-1's KV pipes (none on an engine that only consumes: it never reads);
        `send_write(rank, block_ids, payload)`: a worker's shard on its step pipe."""
        self.rank0 = LocalBlocks(rank0)
        self.pipes = pipes
        self.tp_size = 1 + len(worker_layouts)
        self._layouts = [self.rank0.layout(), *worker_layouts]
        self._shard_bytes = [self.rank0.block_bytes, *(layout["block_bytes"] for layout in worker_layouts)]
        self.block_bytes = sum(self._shard_bytes)
        self._send_write = send_write

    def layout(self) -> dict:
        ranks = [{k: v for k, v in layout.items() if k != "block_bytes"} for layout in self._layouts]
        return {"tensor_parallel_size": self.tp_size, "ranks": ranks}

    def read(self, block_ids: list[int]):
        """The payload's buffers, rank by rank (a generator, as read_blocks: the server sends each
        as it comes); raises ConnectionError or TimeoutError when a worker fails its shard."""
        yield from self.rank0.read(block_ids)
        for pipe in self.pipes:
            yield from pipe.read(block_ids)

    def write(self, block_ids: list[int], payload: bytearray) -> None:
        """Rank 0's shard into its cache, each worker's sent ahead of the next step."""
        n = len(block_ids)
        if len(payload) != n * self.block_bytes:
            raise ValueError(f"payload of {len(payload)} bytes for {n} blocks of {self.block_bytes}")
        view, offset = memoryview(payload), 0
        for rank, shard_bytes in enumerate(self._shard_bytes):
            part = view[offset:offset + n * shard_bytes]
            offset += n * shard_bytes
            if rank == 0:
                self.rank0.write(block_ids, part)
            else:
                self._send_write(rank, block_ids, part)


def worker_layout(cache: KVCache) -> dict:
    """What a worker tells rank 0 of its cache at start: its layout and its bytes per block."""
    return {**LocalBlocks(cache).layout(), "block_bytes": block_bytes(cache)}
