"""KV events from engines into a model's KV index: decoding, one subscriber per deployment, gaps.

Engines (ours, vLLM, SGLang) publish batches of BlockStored / BlockRemoved / AllBlocksCleared on a
ZMQ PUB socket as three frames, [topic, seq (8 bytes, big-endian), msgpack payload]; a ROUTER at
the replay endpoint resends buffered batches from a sequence number on, then [-1, b""] (vLLM 0.32
puts the topic before each seq, as on the live stream: both forms are read). Both the
legacy positional form (arrays tagged by their first element) and the current map form
(`{"type": "BlockStored", ...}`) are accepted, at the batch and at the event level.

The index must never claim a block a deployment does not hold for long: every loss is repaired
or turned into forgetting (a subset of the truth only costs a missed hit):

    seq == expected                 apply
    seq >  expected  (a gap)        replay [expected, seq); if the replay does not reach back, forget
                                    the deployment's blocks and apply what it did send
    in a replay                     each seq >= its start once (the first copy), in order, whether it
                                    ended with its marker or stopped answering; where it skips a seq,
                                    or stops before the live one that asked, forget there
    seq <= the last live one        the publisher restarted (its seqs start again at 0; we may have
                                    missed its first ones): forget, then take the new stream as a
                                    first batch (replay [0, seq) where there is a replay endpoint)
    seq behind, after the last      a live copy of a batch the replay brought: ignored (counted);
      live one                      a payload other than the replayed one's is a restarted publisher
    a frame that does not decode    its batch is lost: forget the deployment's blocks (counted)

One publisher's live seqs only grow (one PUB socket, one sending thread, a connection that keeps
order: vLLM's ZmqEventPublisher, ours), so any live seq that is not past the last one is a new
publisher, however close it is to the expected one. Behind the expected seq but past the last
live one is what a replay already brought (it reaches past the batch that asked for it), unless
the publisher restarted just then: the replayed bytes tell (a publisher resends what it sent).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from gateway.backend import KVEventsSource
from gateway.kv_index.index import KVIndex

log = logging.getLogger("kvgate.kv_events")

END_OF_REPLAY = -1
REPLAY_TIMEOUT_S = 2.0  # per message of a replay
MAX_REPLAYED_AHEAD = 1024  # replayed batches past the live one kept to tell their live copies from a restart
RECEIVE_HWM = 10_000  # batches queued in the SUB socket; a flood past it is a gap, then a replay
YIELD_EVERY = 64  # batches applied before the subscriber lets the event loop serve requests
# A hostile or broken publisher's bounds (one 10.8 MB batch of 1.2 M hashes held the loop 4.1 s):
# an engine's batch is an engine step's blocks, far under these.
MAX_MESSAGE_BYTES = 2 << 20  # zmq.MAXMSGSIZE: a larger message drops the publisher's connection
MAX_EVENTS_PER_BATCH = 4096
MAX_HASHES_PER_BATCH = 1 << 16
APPLY_CHUNK = 4096  # hashes applied before the subscriber yields to the event loop (~2-3 ms)
MAX_REPLAY_BATCHES = 10_000  # a replay longer than this stops there (what it missed is forgotten)
# libzmq reconnects a dropped connection within 0.1 s, but not one it cut for a protocol error
# (a message over MAXMSGSIZE): still down after this long, the subscriber connects afresh.
REVIVE_AFTER_S = 2.0
_U64 = (1 << 64) - 1
_CONNECTION_EVENTS = zmq.EVENT_CONNECTED | zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size")


class BadBatch(ValueError):
    """A payload that is not a KV event batch."""


def _hash(value) -> int:
    """A published block hash as an unsigned 64-bit int (ints, signed ints, or bytes: the last 8)."""
    if isinstance(value, bytes):
        return int.from_bytes(value[-8:], "big")
    if isinstance(value, int) and not isinstance(value, bool):
        return value & _U64
    raise BadBatch(f"block hash of type {type(value).__name__}")


def _event(raw) -> tuple[str, list[int]]:
    """(kind, block hashes) of one event in the map or the positional form."""
    if isinstance(raw, dict):
        kind, fields = raw.get("type"), raw
    elif isinstance(raw, (list, tuple)) and raw and isinstance(raw[0], str):
        kind = raw[0]
        fields = dict(zip(_STORED_FIELDS if kind == "BlockStored" else ("block_hashes",), raw[1:]))
    else:
        raise BadBatch("an event is neither a map nor a tagged array")
    if kind == "AllBlocksCleared":
        return kind, []
    if kind not in ("BlockStored", "BlockRemoved"):
        raise BadBatch(f"unknown event type {kind!r}")
    hashes = fields.get("block_hashes")
    if not isinstance(hashes, (list, tuple)):
        raise BadBatch(f"{kind} without block_hashes")
    return kind, [_hash(h) for h in hashes]


def decode_batch(payload: bytes) -> list[tuple[str, list[int]]]:
    """The events of one payload, as (kind, hashes); BadBatch when it is not a batch, or holds
    more than MAX_EVENTS_PER_BATCH events or MAX_HASHES_PER_BATCH hashes."""
    try:
        batch = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as exc:
        raise BadBatch(f"not msgpack: {exc}") from None
    except RecursionError:  # arrays nested thousands deep: msgspec recurses per level
        raise BadBatch("not a batch: nested too deep") from None
    if isinstance(batch, dict):
        events = batch.get("events")
    elif isinstance(batch, (list, tuple)) and len(batch) >= 2:
        events = batch[1]
    else:
        events = None
    if not isinstance(events, (list, tuple)):
        raise BadBatch("no event list")
    if len(events) > MAX_EVENTS_PER_BATCH:
        raise BadBatch(f"{len(events)} events in one batch, over {MAX_EVENTS_PER_BATCH}")
    decoded, hashes = [], 0
    for raw in events:
        decoded.append(_event(raw))
        hashes += len(decoded[-1][1])
        if hashes > MAX_HASHES_PER_BATCH:
            raise BadBatch(f"over {MAX_HASHES_PER_BATCH} block hashes in one batch")
    return decoded


@dataclass
class StreamStats:
    batches: int = 0  # applied
    events: int = 0
    gaps: int = 0
    resyncs: int = 0  # gaps repaired by a replay
    forgotten: int = 0  # times the deployment's blocks were dropped (loss, restart, garbage)
    garbage: int = 0  # messages that were not KV event batches
    out_of_order: int = 0
    restarts: int = 0
    last_batch_at: float = 0.0  # monotonic


class EventStream:
    """One deployment's KV events, applied to its model's index as they arrive."""

    def __init__(self, deployment: str, source: KVEventsSource, index: KVIndex, context: zmq.asyncio.Context):
        self.deployment = deployment
        self.source = source
        self.index = index
        self.stats = StreamStats()
        self._context = context
        self._expected: int | None = None  # the next seq; None before the first batch
        self._last_live: int | None = None  # the seq of the last batch that came live (not replayed)
        self._replayed_ahead: dict[int, bytes] = {}  # batches a replay brought past its live one
        self._task: asyncio.Task | None = None
        self._watch: asyncio.Task | None = None
        self._sub: zmq.asyncio.Socket | None = None
        self.connected = False

    @property
    def live(self) -> bool:
        """Connected to its publisher, and has heard from it since (the index then knows what the
        engine reported; before, or after the publisher went away, it may not)."""
        return self.connected and self._task is not None and not self._task.done() and self._expected is not None

    def start(self) -> None:
        self._sub = self._context.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.RCVHWM, RECEIVE_HWM)
        self._sub.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self._sub.setsockopt(zmq.SUBSCRIBE, self.source.topic.encode())
        monitor = self._sub.get_monitor_socket(_CONNECTION_EVENTS)
        try:
            (self._sub.bind if self.source.bind else self._sub.connect)(self.source.endpoint)
        except zmq.ZMQError:  # a bad or taken address: the caller routes without these events
            self._sub.disable_monitor()
            monitor.close(linger=0)
            self._sub.close(linger=0)
            self._sub = None
            raise
        loop = asyncio.get_running_loop()
        self._task = loop.create_task(self._run(), name=f"kv-events-{self.deployment}")
        self._watch = loop.create_task(self._watch_connection(monitor), name=f"kv-events-watch-{self.deployment}")

    async def close(self) -> None:
        for task in (self._task, self._watch):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if self._sub is not None:
            self._sub.disable_monitor()
            self._sub.close(linger=0)

    async def _watch_connection(self, monitor) -> None:
        """Follow the publisher's connection: while it is gone the index's view of it may go
        stale (its engine may be restarting), so `live` is false and routing does not trust it."""
        revive = None
        try:
            while True:
                event = parse_monitor_message(await monitor.recv_multipart())["event"]
                was, self.connected = self.connected, event in (zmq.EVENT_CONNECTED, zmq.EVENT_ACCEPTED)
                if was and not self.connected:
                    log.warning("KV events of deployment %s: the publisher at %s went away",
                                self.deployment, self.source.endpoint)
                    if not self.source.bind and (revive is None or revive.done()):
                        revive = asyncio.get_running_loop().create_task(self._revive_later())
        finally:
            if revive is not None:
                revive.cancel()
            monitor.close(linger=0)

    async def _revive_later(self) -> None:
        """Connect afresh when libzmq will not: it cut the connection itself (a message over
        MAX_MESSAGE_BYTES). The old endpoint is dropped first, so there is never a second link."""
        await asyncio.sleep(REVIVE_AFTER_S)
        if self.connected or self._sub is None:
            return
        log.warning("KV events of deployment %s: still no connection to %s (a message over %d bytes cuts it); "
                    "connecting afresh", self.deployment, self.source.endpoint, MAX_MESSAGE_BYTES)
        try:
            self._sub.disconnect(self.source.endpoint)
        except zmq.ZMQError:
            pass  # libzmq already dropped it
        self._sub.connect(self.source.endpoint)

    def forget(self, why: str) -> None:
        """Drop the deployment's blocks and start over from the next batch."""
        if self.index.blocks_of(self.deployment):
            log.warning("KV events of deployment %s: forgetting its %d indexed blocks (%s)",
                        self.deployment, self.index.blocks_of(self.deployment), why)
        self.index.forget(self.deployment)
        self.stats.forgotten += 1

    async def _run(self) -> None:
        applied = 0
        while True:
            frames = await self._sub.recv_multipart()
            try:
                await self._receive(frames)
            except Exception:  # noqa: BLE001 - one bad message never stops the subscription
                log.exception("KV events of deployment %s: a message could not be handled", self.deployment)
            applied += 1
            if applied % YIELD_EVERY == 0:
                await asyncio.sleep(0)  # a flood must not starve the requests on this loop

    async def _receive(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self._garbage(f"{len(frames)} frames, expected [topic, 8-byte seq, payload]")
            return
        seq, payload = int.from_bytes(frames[1], "big"), frames[2]
        if self._last_live is not None and (seq <= self._last_live or self._differs_from_replay(seq, payload)):
            self._restarted(seq)
        self._last_live = seq
        expected = self._expected
        if expected is None:
            if seq > 0 and self.source.replay_endpoint:
                await self._resync(0, seq)  # what it published before we listened
                if self._expected is not None and self._expected > seq:
                    return  # the replay brought this one too
        elif seq < expected:  # past the last live seq: the replay brought it already
            self.stats.out_of_order += 1
            return
        elif seq > expected:
            self.stats.gaps += 1
            await self._resync(expected, seq)
            if self._expected is not None and self._expected > seq:
                return  # the replay brought this one too
        await self._apply(seq, payload)

    def _differs_from_replay(self, seq: int, payload: bytes) -> bool:
        """Whether a live batch the replay brought already came with other bytes (a new publisher
        at that seq); the replayed batches up to it are then no longer awaited."""
        replayed = self._replayed_ahead.get(seq)
        for passed in [s for s in self._replayed_ahead if s <= seq]:
            del self._replayed_ahead[passed]
        return replayed is not None and replayed != payload

    def _restarted(self, seq: int) -> None:
        """A new publisher (its seq went back): what the index holds of the old one is void, and
        the new stream is taken as a first batch, from whatever seq we first hear of it."""
        self.stats.restarts += 1
        self.forget(f"its publisher restarted (seq {seq} after {self._last_live})")
        self._expected = None
        self._replayed_ahead.clear()

    async def _apply(self, seq: int, payload: bytes) -> None:
        """Decode (bounded by MAX_MESSAGE_BYTES and the batch caps) and apply, yielding to the
        event loop every APPLY_CHUNK hashes so that a large batch never holds it for long."""
        self._expected = seq + 1
        try:
            events = decode_batch(payload)
        except BadBatch as exc:
            self._garbage(str(exc))
            self.forget(f"batch {seq} was lost")
            return
        budget = APPLY_CHUNK
        for kind, hashes in events:
            for start in range(0, max(len(hashes), 1), APPLY_CHUNK):
                self._apply_event(kind, hashes[start:start + APPLY_CHUNK])
                budget -= max(len(hashes[start:start + APPLY_CHUNK]), 1)
                if budget <= 0:
                    budget = APPLY_CHUNK
                    await asyncio.sleep(0)
        self.stats.batches += 1
        self.stats.events += len(events)
        self.stats.last_batch_at = time.monotonic()

    def _apply_event(self, kind: str, hashes: list[int]) -> None:
        if kind == "BlockStored":
            self.index.stored(self.deployment, hashes)
        elif kind == "BlockRemoved":
            self.index.removed(self.deployment, hashes)
        else:
            self.index.forget(self.deployment)

    def _garbage(self, what: str) -> None:
        self.stats.garbage += 1
        if self.stats.garbage == 1 or self.stats.garbage % 1000 == 0:
            log.warning("KV events of deployment %s: %d messages were not KV event batches (last: %s)",
                        self.deployment, self.stats.garbage, what)

    async def _resync(self, start: int, upto: int) -> None:
        """Apply the batches [start, ...) the replay endpoint still holds, each once and in order;
        wherever a seq before `upto` (the live batch that showed the gap) is missing from it, forget
        there: what that batch removed is unknown."""
        batches = await self._replay(start) if self.source.replay_endpoint else []
        if batches and batches[0][0] == start:
            self.stats.resyncs += 1
        what = "no replay endpoint" if not self.source.replay_endpoint else "the replay did not reach back"
        following = start
        for seq, payload in batches:
            if seq > following:
                self.forget(f"batches {following}..{seq - 1} were missed, {what}")
            await self._apply(seq, payload)
            following, what = seq + 1, "the replay skipped them"
            if seq > upto and len(self._replayed_ahead) < MAX_REPLAYED_AHEAD:
                self._replayed_ahead[seq] = payload  # its live copy is still on the way
        if following < upto and (following > start or start > 0):
            self.forget(f"batches {following}..{upto - 1} were missed, "
                        + ("the replay stopped short" if batches else what))

    async def _replay(self, start: int) -> list[tuple[int, bytes]]:
        dealer = self._context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        batches: list[tuple[int, bytes]] = []
        try:
            dealer.connect(self.source.replay_endpoint)
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while await dealer.poll(int(REPLAY_TIMEOUT_S * 1000)):
                frames = _replayed_frames(await dealer.recv_multipart())
                if frames is None:
                    break
                seq = int.from_bytes(frames[0], "big", signed=True)
                if seq == END_OF_REPLAY:
                    return _once_in_order(batches, start)
                batches.append((seq, frames[1]))
                if len(batches) >= MAX_REPLAY_BATCHES:  # a replay that never ends must not fill memory
                    log.warning("KV events of deployment %s: the replay from %d passed %d batches; stopped there",
                                self.deployment, start, MAX_REPLAY_BATCHES)
                    return _once_in_order(batches, start)
            log.warning("KV events of deployment %s: the replay from %d did not finish", self.deployment, start)
            return _once_in_order(batches, start)
        finally:
            dealer.close(linger=0)


def _replayed_frames(frames: list[bytes]) -> list[bytes] | None:
    """[seq, payload] of one replay message, in either form a vLLM sends behind the DEALER's empty
    frame: [b"", seq, payload] (older releases) or [b"", topic, seq, payload], a live batch's
    frames (vLLM 0.32's ZmqEventPublisher; its end marker [b"", b"", -1, b""]); None otherwise."""
    if len(frames) not in (3, 4) or len(frames[-2]) != 8:
        return None
    return frames[-2:]


def _once_in_order(batches: list[tuple[int, bytes]], start: int) -> list[tuple[int, bytes]]:
    """A replay's batches from `start` on, each seq once (its first copy), in sequence order: the
    wire format promises that order, but a batch applied twice or late can revive a block the
    engine has since removed."""
    first: dict[int, bytes] = {}
    for seq, payload in batches:
        if seq >= start:
            first.setdefault(seq, payload)
    return sorted(first.items())
