"""KV events on the wire, as vLLM publishes them (`ZmqEventPublisher`), so that any subscriber
written for vLLM (llm-d's indexer, the gateway's KV index) reads our engines too.

    engine loop ── publish(events) ──> queue ──> publisher thread ──PUB──> [topic, seq, payload]
                                                      │  keeps the last buffer_steps payloads
    subscriber ── DEALER/REQ [start seq] ──ROUTER──>  └─ resends [seq, payload] for each seq >= start,
                                                         then [-1 (signed, 8 bytes), b""]

payload: msgpack of the batch `{ts, events}` with each event a map tagged by its class name,
`{"type": "BlockStored", "block_hashes": [...], ...}` (vLLM's current form; the legacy form was
positional arrays). seq: 8 bytes, big-endian, from 0, one per batch. The engine loop only puts a
batch on a queue: encoding and sending happen on this module's thread, never inside a step.
"""

from __future__ import annotations

import ipaddress
import logging
import queue
import socket
import threading
import time
from collections import deque

import msgspec
import zmq

from native_backend.config.engine import KVEventsOptions
from native_backend.core import kv_events as core_events

log = logging.getLogger("kvgate.engine.kv_events")

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
MAX_QUEUED_BATCHES = 100_000  # batches waiting for the thread (vLLM's max_queue_size)
_IDLE_POLL_S = 0.05  # how long the thread waits for a batch before it looks at replay requests


class _Event(msgspec.Struct, tag=True, omit_defaults=True):
    pass


class BlockStored(_Event):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    lora_name: str | None = None  # vLLM's: the adapter whose KV the blocks hold (omitted for the base)


class BlockRemoved(_Event):
    block_hashes: list[int]


class AllBlocksCleared(_Event):
    pass


class KVEventBatch(msgspec.Struct, omit_defaults=True):
    ts: float  # unix seconds
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


def to_wire(event: core_events.KVEvent, token_ids: bool = False) -> _Event:
    """The event as sent; BlockStored's token_ids empty unless `token_ids` (kv_events.publish_token_ids):
    they are the tenants' prompts, and the hashes alone are what a router indexes."""
    if isinstance(event, core_events.BlockStored):
        tokens = list(event.token_ids) if token_ids else []
        return BlockStored(list(event.block_hashes), event.parent_block_hash, tokens, event.block_size,
                           lora_name=event.lora_name)
    if isinstance(event, core_events.BlockRemoved):
        return BlockRemoved(list(event.block_hashes))
    return AllBlocksCleared()


LOOPBACK_HOSTS = ("tcp://127.", "tcp://localhost:", "tcp://[::1]:")


def binds(endpoint: str) -> bool:
    """vLLM's rule (a wildcard host or a local transport is bound, anything else connected to),
    and a loopback host or another address of this machine is bound too (vLLM connects to
    them): the default publisher, on loopback, and a pod's, on its pod IP (the Helm chart)."""
    return ("*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))
            or endpoint.startswith(LOOPBACK_HOSTS) or _own_address(endpoint))


def _own_address(endpoint: str) -> bool:
    """Whether a tcp:// endpoint's host is an IP address of this machine: one a socket can bind
    (a name is never resolved here, and a remote address is EADDRNOTAVAIL)."""
    if not endpoint.startswith("tcp://"):
        return False
    host = endpoint.removeprefix("tcp://").rpartition(":")[0].strip("[]")
    try:
        family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    except ValueError:
        return False
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((host, 0))
        except OSError:
            return False
    return True


class KVEventPublisher:
    """Publishes batches of core KV events; `publish` is the engine's sink (thread-safe, never blocks)."""

    def __init__(self, options: KVEventsOptions, data_parallel_rank: int | None = None):
        self.options = options
        self._rank = data_parallel_rank
        self._topic = options.topic.encode()
        self._queue: queue.Queue = queue.Queue(MAX_QUEUED_BATCHES)
        self._encoder = msgspec.msgpack.Encoder()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=options.buffer_steps)  # (seq, payload)
        self._next_seq = 0
        self.num_dropped = 0  # batches the queue had no room for (a stalled publisher thread)
        self._context = zmq.Context()
        # Sockets are made (and bound) here, so a taken port fails the engine's start, and are
        # used only by the thread from then on.
        self._pub = self._socket(zmq.PUB, options.endpoint)
        self._pub.setsockopt(zmq.SNDHWM, options.hwm)
        self._replay = self._socket(zmq.ROUTER, options.replay_endpoint, bind=True) if options.replay_endpoint else None
        self._thread = threading.Thread(target=self._run, name="kvgate-kv-events", daemon=True)
        self._thread.start()

    @property
    def bound_endpoint(self) -> str:
        """Where the PUB socket listens, as bound: a `tcp://host:*` endpoint's real port."""
        return self._pub.getsockopt(zmq.LAST_ENDPOINT).decode()

    @property
    def bound_replay_endpoint(self) -> str | None:
        return self._replay.getsockopt(zmq.LAST_ENDPOINT).decode() if self._replay is not None else None

    def _socket(self, kind: int, endpoint: str, bind: bool | None = None) -> zmq.Socket:
        sock = self._context.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if binds(endpoint) if bind is None else bind:
            sock.bind(endpoint)
        else:
            sock.connect(endpoint)
        return sock

    def publish(self, events: list[core_events.KVEvent]) -> None:
        try:
            self._queue.put_nowait((time.time(), events))
        except queue.Full:  # a subscriber that resyncs through replay learns of the loss from the seq
            self.num_dropped += 1
            if self.num_dropped == 1 or self.num_dropped % 1000 == 0:
                log.warning("KV events: %d batches dropped (publisher thread behind)", self.num_dropped)

    def close(self, timeout_s: float = 2.0) -> None:
        """Send what is queued, then stop the thread and close the sockets."""
        self._queue.put(None)
        self._thread.join(timeout_s)
        if not self._thread.is_alive():
            self._context.destroy(linger=0)

    # --- the thread ----------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=_IDLE_POLL_S)
            except queue.Empty:
                item = ()
            if item is None:
                return
            if item:
                self._send(*item)
            if self._replay is not None:
                self._serve_replays()

    def _send(self, ts: float, events: list[core_events.KVEvent]) -> None:
        batch = KVEventBatch(ts, [to_wire(e, self.options.publish_token_ids) for e in events], self._rank)
        payload = self._encoder.encode(batch)
        seq = self._next_seq
        self._next_seq += 1
        self._buffer.append((seq, payload))
        try:
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
        except zmq.Again:  # past the high-water mark: the subscriber sees the gap and replays
            pass

    def _serve_replays(self) -> None:
        while self._replay.poll(0):
            frames = self._replay.recv_multipart()
            # REQ clients put an empty delimiter between their identity and the request; DEALERs may not.
            envelope, request = frames[:-1], frames[-1]
            if len(request) != 8 or not 1 <= len(envelope) <= 2:
                log.warning("KV events: malformed replay request (%d frames) ignored", len(frames))
                continue
            start = int.from_bytes(request, "big")
            for seq, payload in self._buffer:
                if seq >= start:
                    self._replay.send_multipart((*envelope, seq.to_bytes(8, "big"), payload))
            self._replay.send_multipart((*envelope, END_OF_REPLAY, b""))
