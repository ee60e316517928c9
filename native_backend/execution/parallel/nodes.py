"""An engine that spans machines: the rendezvous where other nodes' ranks join rank 0.

    node 0 (the engine, rank 0)                         node n > 0 (`kvgate engine --headless`)
    listens on master_addr:master_port ────────────── the node agent connects, proves the secret,
      (loopback unless master_addr says otherwise)       asks ("node", n) ──> ("ranks", its ranks)
                                                       spawns one process per rank; each connects,
                                                       proves the secret, says ("rank", r)
    <── every remote rank's connection then serves as that rank's pipe (worker.py's messages) ──>

Every connection is authenticated both ways before anything is unpickled: a challenge-response
over a shared secret (HMAC-SHA256 of both sides' random nonces), so a peer without the secret is
refused with a log line naming it (the engine keeps waiting for the right one), and a rank never
takes steps from an impostor posing as rank 0. The connections are not encrypted: run nodes on a
private network. The listener closes once every rank has joined.

After the rendezvous the ranks form the torch.distributed group: rank 0's store listens on
master_addr (a port the kernel picks, told to the authenticated ranks only) and gloo/NCCL use the
interface that holds this node's address towards master_addr (GLOO_SOCKET_IFNAME /
NCCL_SOCKET_IFNAME override it). Neither the store nor gloo/NCCL authenticate a peer
(docs/engine/pipeline-parallel.md, "Across machines").
"""

from __future__ import annotations

import fcntl
import hashlib
import hmac
import logging
import os
import socket
import struct
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection

log = logging.getLogger("kvgate.engine")

SECRET_ENV = "KVGATE_RENDEZVOUS_SECRET"
MIN_SECRET_BYTES = 16
MAGIC = b"kvgate-rendezvous-1\n"
NONCE_BYTES = 32
MAC_BYTES = 32
HANDSHAKE_TIMEOUT_S = 5.0  # a peer that connects and stays silent holds the listener this long at most
HELLO_TIMEOUT_S = 10.0  # an authenticated peer's first message
WAITING_LOG_S = 30.0  # how often rank 0 says whom it still waits for
SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address


class RendezvousError(RuntimeError):
    """A peer could not be authenticated, or the rendezvous went wrong."""


def load_secret(path: str | None) -> bytes:
    """The shared secret: the file's contents (stripped), else $KVGATE_RENDEZVOUS_SECRET; at least
    MIN_SECRET_BYTES. ValueError saying where to put one."""
    if path:
        try:
            with open(path, "rb") as f:
                secret = f.read().strip()
        except OSError as exc:
            raise ValueError(f"rendezvous secret file {path}: {exc.strerror}") from None
        where = f"file {path}"
    else:
        secret, where = os.environ.get(SECRET_ENV, "").strip().encode(), f"${SECRET_ENV}"
    if not secret:
        raise ValueError(f"an engine across nodes needs a shared secret: set {SECRET_ENV} or a rendezvous "
                         "secret file (the same on every node)")
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"the rendezvous secret in {where} is {len(secret)} bytes; at least {MIN_SECRET_BYTES}")
    return secret


def _mac(secret: bytes, side: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.new(secret, side + server_nonce + client_nonce, hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
    """n bytes (fewer: the peer closed); socket.timeout past `deadline` (a peer trickling bytes
    holds the listener no longer than one that sends nothing)."""
    data = b""
    while len(data) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise socket.timeout("handshake deadline")
        sock.settimeout(left)
        chunk = sock.recv(n - len(data))
        if not chunk:
            break
        data += chunk
    return data


def _as_connection(sock: socket.socket) -> Connection:
    """The authenticated socket as a multiprocessing Connection (worker.py's pipe API), with TCP
    keepalive so a node that vanishes without closing its connections is noticed."""
    sock.settimeout(None)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
    return Connection(sock.detach())


def server_handshake(sock: socket.socket, secret: bytes) -> Connection:
    """Rank 0's side: challenge the peer; RendezvousError (and the socket closed) unless it proves
    the secret. Nothing the peer sends is unpickled before that."""
    try:
        deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S
        sock.settimeout(HANDSHAKE_TIMEOUT_S)
        server_nonce = os.urandom(NONCE_BYTES)
        sock.sendall(MAGIC + server_nonce)
        reply = _recv_exact(sock, len(MAGIC) + MAC_BYTES + NONCE_BYTES, deadline)
        if reply[:len(MAGIC)] != MAGIC or len(reply) < len(MAGIC) + MAC_BYTES + NONCE_BYTES:
            raise RendezvousError("it does not speak kvgate's rendezvous protocol")
        mac, client_nonce = reply[len(MAGIC):-NONCE_BYTES], reply[-NONCE_BYTES:]
        if not hmac.compare_digest(mac, _mac(secret, b"rank", server_nonce, client_nonce)):
            raise RendezvousError("it does not know the shared secret")
        sock.sendall(_mac(secret, b"engine", server_nonce, client_nonce))
        return _as_connection(sock)
    except (OSError, RendezvousError) as exc:
        sock.close()
        if isinstance(exc, socket.timeout):
            raise RendezvousError(f"it sent no answer within {HANDSHAKE_TIMEOUT_S:g} s") from None
        if isinstance(exc, OSError):
            raise RendezvousError(f"the connection failed: {exc}") from None
        raise


def client_handshake(sock: socket.socket, secret: bytes, where: str) -> Connection:
    """A rank's side: answer rank 0's challenge, then check that rank 0 knows the secret too."""
    try:
        deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S
        sock.settimeout(HANDSHAKE_TIMEOUT_S)
        hello = _recv_exact(sock, len(MAGIC) + NONCE_BYTES, deadline)
        if hello[:len(MAGIC)] != MAGIC or len(hello) < len(MAGIC) + NONCE_BYTES:
            raise RendezvousError(f"{where} is not a kvgate engine's rendezvous")
        server_nonce, client_nonce = hello[len(MAGIC):], os.urandom(NONCE_BYTES)
        sock.sendall(MAGIC + _mac(secret, b"rank", server_nonce, client_nonce) + client_nonce)
        proof = _recv_exact(sock, MAC_BYTES, deadline)
        if not proof:
            raise RendezvousError(f"the engine at {where} refused this node: its rendezvous secret differs")
        if not hmac.compare_digest(proof, _mac(secret, b"engine", server_nonce, client_nonce)):
            raise RendezvousError(f"{where} does not know the shared secret (not our engine)")
        return _as_connection(sock)
    except OSError as exc:
        sock.close()
        raise RendezvousError(f"rendezvous with {where} failed: {exc}") from None
    except RendezvousError:
        sock.close()
        raise


def connect(host: str, port: int, secret: bytes, hello: tuple) -> tuple[Connection, tuple]:
    """Connect to rank 0's rendezvous, authenticate, send `hello`, return the connection and rank
    0's answer. OSError: nobody listens (yet); RendezvousError: refused."""
    where = f"{host}:{port}"
    sock = socket.create_connection((host, port), timeout=HANDSHAKE_TIMEOUT_S)
    conn = client_handshake(sock, secret, where)
    conn.send(hello)
    if not conn.poll(HELLO_TIMEOUT_S):
        conn.close()
        raise RendezvousError(f"the engine at {where} did not answer {hello[0]!r}")
    answer = conn.recv()
    if answer[0] == "refused":
        conn.close()
        raise RendezvousError(f"the engine at {where} refused {hello}: {answer[1]}")
    return conn, answer


def interface_of(address: str) -> str | None:
    """The name of the network interface holding IPv4 `address` (Linux), None when none does."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(probe.fileno(), SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
            except OSError:
                continue  # no IPv4 address on it
            if socket.inet_ntoa(packed[20:24]) == address:
                return name
    finally:
        probe.close()
    return None


def use_interface_towards(local_address: str) -> None:
    """gloo's and NCCL's sockets on the interface of this node's address towards rank 0 (unless
    GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME name one): group.join_group would keep them on loopback."""
    name = interface_of(local_address)
    if name is None:
        log.warning("no interface holds %s: gloo/NCCL choose their own (set GLOO_SOCKET_IFNAME / "
                    "NCCL_SOCKET_IFNAME)", local_address)
        return
    os.environ.setdefault("GLOO_SOCKET_IFNAME", name)
    os.environ.setdefault("NCCL_SOCKET_IFNAME", name)


def node_ranks(world: int, nnodes: int, node: int) -> list[int]:
    """The ranks node `node` holds: world / nnodes consecutive ones (TP inside a node, stages across)."""
    per_node = world // nnodes
    return list(range(node * per_node, (node + 1) * per_node))


@dataclass
class JoinedRank:
    rank: int
    conn: Connection
    peer: str  # its address, for the logs and errors


class NodeListener:
    """Rank 0's rendezvous: bound to master_addr:master_port (loopback unless configured), open
    until every other node's ranks have joined."""

    def __init__(self, host: str, port: int, secret: bytes, world: int, nnodes: int):
        self.secret, self.world, self.nnodes = secret, world, nnodes
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        self.sock = socket.create_server((host, port), family=family, backlog=16)
        self.address = self.sock.getsockname()[0]  # master_addr resolved: where the store binds too
        self.where = f"{host}:{self.sock.getsockname()[1]}"

    def remote_ranks(self) -> list[int]:
        return [r for n in range(1, self.nnodes) for r in node_ranks(self.world, self.nnodes, n)]

    def wait_for_ranks(self, timeout_s: float) -> dict[int, JoinedRank]:
        """Accept until every remote rank has joined; a peer that fails the handshake or asks for
        something it cannot have is refused and logged, and the wait goes on. RendezvousError after
        `timeout_s`, naming the nodes still missing."""
        joined: dict[int, JoinedRank] = {}
        wanted = self.remote_ranks()
        deadline, next_note = time.monotonic() + timeout_s, time.monotonic()
        log.info("waiting for nodes 1..%d to join at %s (ranks %s)", self.nnodes - 1, self.where, wanted)
        while len(joined) < len(wanted):
            now = time.monotonic()
            if now >= deadline:
                raise RendezvousError(f"nodes {self._missing(joined)} did not join at {self.where} within "
                                      f"{timeout_s:g} s")
            if now >= next_note:
                next_note = now + WAITING_LOG_S
                log.info("still waiting for nodes %s at %s", self._missing(joined), self.where)
            self.sock.settimeout(min(deadline, next_note) - now)
            try:
                sock, peer = self.sock.accept()
            except socket.timeout:
                continue
            self._admit(sock, f"{peer[0]}:{peer[1]}", joined)
        return joined

    def _missing(self, joined: dict) -> list[int]:
        return sorted({r // (self.world // self.nnodes) for r in self.remote_ranks() if r not in joined})

    def _admit(self, sock: socket.socket, peer: str, joined: dict[int, JoinedRank]) -> None:
        try:
            conn = server_handshake(sock, self.secret)
        except RendezvousError as exc:
            log.warning("rendezvous at %s refused a peer from %s: %s", self.where, peer, exc)
            return
        try:
            hello = conn.recv() if conn.poll(HELLO_TIMEOUT_S) else ("(nothing)",)
            answer, rank = self._answer(hello, joined)
            conn.send(answer)
        except (OSError, EOFError) as exc:
            log.warning("rendezvous at %s: the peer from %s went away: %s", self.where, peer, exc)
            conn.close()
            return
        if rank is None:
            if answer[0] == "refused":
                log.warning("rendezvous at %s refused %s from %s: %s", self.where, hello, peer, answer[1])
            conn.close()
            return
        log.info("rank %d joined from %s", rank, peer)
        joined[rank] = JoinedRank(rank, conn, peer)

    def _answer(self, hello: tuple, joined: dict) -> tuple[tuple, int | None]:
        """("node", n): that node's ranks; ("rank", r): accepted (the executor sends its start)."""
        kind = hello[0] if isinstance(hello, tuple) and hello else None
        if kind == "node" and isinstance(hello[1], int) and 0 < hello[1] < self.nnodes:
            return ("ranks", node_ranks(self.world, self.nnodes, hello[1]), self.world), None
        if kind == "node":
            reason = f"node rank {hello[1]!r} is not one of 1..{self.nnodes - 1} (nnodes {self.nnodes})"
            return ("refused", reason), None
        if kind == "rank" and hello[1] in self.remote_ranks() and hello[1] not in joined:
            return ("accepted", hello[1]), hello[1]
        if kind == "rank":
            return ("refused", f"rank {hello[1]!r} is not an open rank of this engine"), None
        return ("refused", "unknown request"), None

    def close(self) -> None:
        self.sock.close()


class RemoteRank:
    """What rank 0 knows of a rank on another node: its connection, in the shape of the
    multiprocessing.Process the executor watches for its local workers. The connection closing
    (peeked, not read) is the rank's death: a remote rank sends nothing unasked but its error."""

    pid = None  # not a process of this machine: never "stopped" in /proc; the step deadline covers it
    exitcode = None

    def __init__(self, conn: Connection, node: int, peer: str):
        self.conn, self.node, self.peer = conn, node, peer
        self._peek = socket.socket(fileno=os.dup(conn.fileno()))
        self._gone = False

    @property
    def sentinel(self) -> Connection:
        return self.conn  # readable: an error report, or the connection closed

    def is_alive(self) -> bool:
        if not self._gone:
            try:
                self._gone = self._peek.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
            except BlockingIOError:
                pass
            except OSError:
                self._gone = True
        return not self._gone

    def join(self, timeout: float | None = None) -> None:
        deadline = time.monotonic() + (timeout or 0)
        while self.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)

    def kill(self) -> None:
        """Close our side: the rank reads EOF and exits (its node agent starts it afresh)."""
        try:
            self._peek.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._gone = True

    def describe_exit(self) -> str:
        return f"on node {self.node} ({self.peer}) closed its connection: it died, or its node went away"

    def close(self) -> None:
        self._peek.close()
