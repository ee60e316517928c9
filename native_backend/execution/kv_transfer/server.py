"""A producer's listener: each connection is one read of blocks held for one request.

A read is served only when HeldBlocks grants it (this engine's id, a request whose blocks are
held, those very block ids at those positions, the hashes of their tokens) and the consumer's
cache layout is this one's; anything else is answered with the reason and counted, and no byte of
the cache leaves. The blocks go back to the step loop once sent (a consumer reads once), or when
the send breaks (the consumer recomputes). Under tensor parallelism the blocks are every rank's
(parallel.kv_relay: the workers' shards come through rank 0); a rank that fails to give its shard
breaks the send, so the consumer recomputes the whole prompt, never a partial KV.

A connection that has not sent its read request within HEADER_TIMEOUT_S is closed (an idle
socket must not hold a slot). At most `max_connections` reads are served at once, a thread each
(kv_transfer_max_connections):
a connection beyond is answered with the refusal at once, from the accepting thread, and closed
(counted as refused; its consumer recomputes), so a flood of connections cannot pile up threads.
"""

from __future__ import annotations

import hashlib
import json
import logging
import socket
import threading

from native_backend.core.kv_connector import HeldBlocks
from native_backend.execution.kv_transfer.blocks import layout_difference
from native_backend.execution.kv_transfer.trust import payload_mac
from native_backend.execution.kv_transfer.wire import recv_header, send_header

log = logging.getLogger("kvgate.kv_transfer")
READ_TIMEOUT_S = 30.0  # a consumer that stops reading for this long loses its read
# A connection's read request must arrive within this: an idle socket holds one of the
# max_connections slots, so 64 of them at the old 30 s refused every real read for 30 s.
HEADER_TIMEOUT_S = 1.0
REFUSAL_TIMEOUT_S = 1.0  # sending the refusal of a connection over the cap: never blocks the accepting thread long


class KVBlockServer:
    def __init__(self, blocks, held: HeldBlocks, host: str, port: int, max_connections: int = 64,
                 key: bytes = b""):
        self.blocks = blocks  # blocks.LocalBlocks, or parallel.kv_relay.TensorParallelBlocks
        self.key = key  # the engines' shared secret: the payload's MAC (trust.payload_mac)
        self.held = held
        self.max_connections = max_connections
        self._slots = threading.BoundedSemaphore(max_connections)  # one per connection being served
        self.layout = json.loads(json.dumps(blocks.layout()))  # as a peer's arrives: through JSON
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.create_server((host, port), family=family)
        self.port = self._sock.getsockname()[1]
        threading.Thread(target=self._accept, name="kvgate-kv-serve", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            if not self._slots.acquire(blocking=False):
                self._refuse_over_cap(conn)
                continue
            try:
                threading.Thread(target=self._serve_in_slot, args=(conn,), name="kvgate-kv-read", daemon=True).start()
            except RuntimeError:  # no thread to be had: the read is refused, as over the cap
                self._slots.release()
                self._refuse_over_cap(conn)

    def _refuse_over_cap(self, conn: socket.socket) -> None:
        """Answer a connection beyond kv_transfer_max_connections without reading it, and close it."""
        self.held.note_refused()
        with conn:
            try:
                conn.settimeout(REFUSAL_TIMEOUT_S)
                send_header(conn, {"ok": False, "error": f"the producer serves {self.max_connections} reads at "
                                   "once (kv_transfer_max_connections); try again or recompute"})
            except OSError:
                pass  # the consumer sees the connection close: it recomputes all the same

    def _serve_in_slot(self, conn: socket.socket) -> None:
        try:
            self._serve(conn)
        finally:
            self._slots.release()

    def close(self) -> None:
        self._sock.close()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(HEADER_TIMEOUT_S)
            try:
                header = recv_header(conn)
                conn.settimeout(READ_TIMEOUT_S)
                read, refusal = self._grant(header)
                if refusal is not None:
                    send_header(conn, {"ok": False, "error": refusal})
                    return
            except (OSError, ValueError) as exc:
                log.info("a KV read request that could not be read: %s", exc)
                return
            self._send(conn, *read)

    def _grant(self, header: dict) -> tuple[tuple | None, str | None]:
        """(the hold, block_ids) of a read HeldBlocks granted, or the refusal."""
        try:
            request_id, engine_id = str(header["request_id"]), str(header["engine_id"])
            block_ids = [int(b) for b in header["block_ids"]]
            hashes = [bytes.fromhex(h) for h in header["block_hashes"]]
            first_block = int(header["first_block"])
        except (KeyError, TypeError, ValueError) as exc:
            self.held.note_refused()
            return None, f"malformed read request: {type(exc).__name__}"
        if header.get("layout") != self.layout:
            self.held.note_refused()
            return None, layout_difference(self.layout, header.get("layout"))
        hold, refusal = self.held.claim(engine_id, request_id, block_ids, hashes, first_block)
        return ((hold, block_ids, hashes), None) if refusal is None else (None, refusal)

    def _send(self, conn: socket.socket, hold, block_ids: list[int], hashes: list[bytes]) -> None:
        """The blocks' bytes, then a trailer with their MAC (what the consumer checks before it
        counts them as computed)."""
        served = False
        digest = hashlib.sha256()
        try:
            send_header(conn, {"ok": True, "nbytes": len(block_ids) * self.blocks.block_bytes})
            for buffer in self.blocks.read(block_ids):
                digest.update(buffer)
                conn.sendall(buffer)
            mac = payload_mac(self.key, self.held.engine_id, hold.seq.request_id, hashes, digest.digest())
            send_header(conn, {"mac": mac})
            served = True
        except OSError as exc:  # a tensor-parallel rank's shard that failed too (kv_relay raises OSError)
            log.info("request %s: sending its KV blocks broke off: %s", hold.seq.request_id, exc)
        finally:
            self.held.release(hold, served)
