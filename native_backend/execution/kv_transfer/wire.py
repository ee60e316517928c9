"""One read on the wire: a consumer's request, the producer's answer, then the blocks' bytes.

    consumer -> producer   [4-byte big-endian length][JSON: engine_id, request_id, block_ids,
                                                      first_block, block_hashes (hex), layout]
    producer -> consumer   [4-byte big-endian length][JSON: ok, nbytes | error]
                           [nbytes of blocks.read_blocks' payload]
                           [4-byte big-endian length][JSON: mac (trust.payload_mac of the payload)]

Headers are small and bounded (MAX_HEADER_BYTES): a peer that sends more is cut off.
"""

from __future__ import annotations

import json
import socket
import struct

MAX_HEADER_BYTES = 1 << 20
_LENGTH = struct.Struct(">I")


def send_header(sock: socket.socket, header: dict) -> None:
    body = json.dumps(header, separators=(",", ":")).encode()
    sock.sendall(_LENGTH.pack(len(body)) + body)


def recv_header(sock: socket.socket) -> dict:
    (length,) = _LENGTH.unpack(recv_exact(sock, _LENGTH.size))
    if length > MAX_HEADER_BYTES:
        raise ValueError(f"a header of {length} bytes")
    header = json.loads(recv_exact(sock, length))
    if not isinstance(header, dict):
        raise ValueError("a header that is not an object")
    return header


def recv_exact(sock: socket.socket, n: int) -> bytearray:
    """Exactly n bytes, or ConnectionError when the peer closes first."""
    buffer = bytearray(n)
    view, got = memoryview(buffer), 0
    while got < n:
        size = sock.recv_into(view[got:], n - got)
        if size == 0:
            raise ConnectionError(f"the peer closed after {got} of {n} bytes")
        got += size
    return buffer
