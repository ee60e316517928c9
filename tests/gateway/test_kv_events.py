"""KV events into the gateway's index: both wire forms, the engine's own publisher, and the faults
a publisher can commit (disappearing, restarting, garbage, out-of-order sequence numbers, floods):
the index stays consistent and bounded and the deployment is named in a warning.

The faulty publishers are raw ZMQ sockets driven by each test; the well-behaved one is the
engine's (native_backend.process.kv_publisher) fed by a real block manager."""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec
import pytest
import zmq
import zmq.asyncio

from gateway.backend import KVEventsSource
from gateway.kv_index import events as kv_events
from gateway.kv_index.events import BadBatch, EventStream, decode_batch
from gateway.kv_index.index import KVIndex
from native_backend.config.engine import KVEventsOptions
from native_backend.core import kv_events as core
from native_backend.process.kv_publisher import KVEventPublisher

ENCODE = msgspec.msgpack.encode


def stored(*hashes, legacy=False):
    if legacy:
        return ["BlockStored", list(hashes), None, list(range(4 * len(hashes))), 4, None]
    return {"type": "BlockStored", "block_hashes": list(hashes), "parent_block_hash": None,
            "token_ids": list(range(4 * len(hashes))), "block_size": 4}


def removed(*hashes):
    return {"type": "BlockRemoved", "block_hashes": list(hashes)}


CLEARED = {"type": "AllBlocksCleared"}


def batch(*events, legacy=False) -> bytes:
    return ENCODE([time.time(), list(events)] if legacy else {"ts": time.time(), "events": list(events)})


def test_both_wire_forms_decode_to_the_same_events():
    current = decode_batch(batch(stored(1, 2), removed(2), CLEARED))
    legacy = decode_batch(ENCODE([1.0, [stored(1, 2, legacy=True), ["BlockRemoved", [2], "GPU"],
                                        ["AllBlocksCleared"]]]))
    assert current == legacy == [("BlockStored", [1, 2]), ("BlockRemoved", [2]), ("AllBlocksCleared", [])]
    # bytes hashes count by their last 8 bytes; signed int64 ones as unsigned
    assert decode_batch(batch(stored(b"\xff" * 24 + (5).to_bytes(8, "big"), -1))) == [("BlockStored", [5, 2**64 - 1])]


@pytest.mark.parametrize("payload", [
    b"\xc1", ENCODE({"ts": 1.0}), ENCODE([1.0, [{"type": "Nope"}]]),
    ENCODE({"ts": 1, "events": [{"type": "BlockStored"}]}), ENCODE("x"),
    b"\x91" * 200_000 + b"\xc0",  # arrays nested 200,000 deep: msgspec's RecursionError, a bad batch
    ENCODE({"ts": 1, "events": [removed(1)] * 4097}),  # over 4,096 events
    ENCODE({"ts": 1, "events": [removed(*range(40_000)), removed(*range(30_000))]}),  # over 65,536 hashes
], ids=["not-msgpack", "no-events", "unknown-type", "no-hashes", "a-string", "nested", "events", "hashes"])
def test_what_is_not_a_batch_is_refused(payload):
    with pytest.raises(BadBatch):
        decode_batch(payload)


def bind_any_port(socket) -> int:
    """Binds `socket` to a port the system picks and returns it (no port picked, freed and bound
    later, which another process on the machine could take in between)."""
    socket.bind("tcp://127.0.0.1:*")
    return int(socket.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])


class RawPublisher:
    """A publisher the test drives frame by frame, with an optional replay endpoint serving what
    the test put in `kept` (or, to script a faulty one, the frames in `replay_script`, followed by
    the end marker only when `replay_ends`)."""

    def __init__(self, context: zmq.asyncio.Context, topic: bytes = b"kv"):
        self.pub = context.socket(zmq.PUB)
        self.port = bind_any_port(self.pub)
        self.router = context.socket(zmq.ROUTER)
        self.replay_port = bind_any_port(self.router)
        self.topic = topic
        self.kept: dict[int, bytes] = {}
        self.replays: list[int] = []
        self.replay_script: list[tuple[int, bytes]] | None = None
        self.replay_ends = True
        self.replay_topic = False  # vLLM 0.32's replay: [topic, seq, payload], end [b"", -1, b""]
        self._server = asyncio.get_running_loop().create_task(self._serve())

    def source(self, replay=True) -> KVEventsSource:
        return KVEventsSource(f"tcp://127.0.0.1:{self.port}",
                              f"tcp://127.0.0.1:{self.replay_port}" if replay else None, topic="kv", block_size=4)

    async def send(self, seq: int, payload: bytes, keep=True) -> None:
        if keep:
            self.kept[seq] = payload
        await self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])

    async def _serve(self) -> None:
        while True:
            ident, empty, start = await self.router.recv_multipart()
            first = int.from_bytes(start, "big")
            self.replays.append(first)
            frames = self.replay_script
            if frames is None:
                frames = [(seq, self.kept[seq]) for seq in sorted(s for s in self.kept if s >= first)]
            topic = [self.topic] if self.replay_topic else []
            for seq, payload in frames:
                await self.router.send_multipart([ident, empty, *topic, seq.to_bytes(8, "big"), payload])
            if self.replay_ends:
                end = [b""] if self.replay_topic else []
                await self.router.send_multipart([ident, empty, *end, (-1).to_bytes(8, "big", signed=True), b""])

    def close(self) -> None:
        self._server.cancel()
        self.pub.close(linger=0)
        self.router.close(linger=0)


async def until(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


def run(scenario):
    """Run `scenario(context, publisher, stream_for)` with a raw publisher and a way to follow it."""
    async def main():
        context = zmq.asyncio.Context()
        publisher = RawPublisher(context)
        streams = []

        async def stream_for(index: KVIndex, replay=True, name="engine-a") -> EventStream:
            stream = EventStream(name, publisher.source(replay), index, context)
            stream.start()
            streams.append(stream)
            await until(lambda: stream.connected)
            await asyncio.sleep(0.2)  # the subscription travels to the PUB after the connection
            return stream
        try:
            await scenario(context, publisher, stream_for)
        finally:
            for stream in streams:
                await stream.close()
            publisher.close()
            context.term()
    asyncio.run(main())


@pytest.mark.parametrize("replay_topic", [False, True], ids=["seq-payload", "vllm-0.32-topic-seq-payload"])
def test_a_gap_is_repaired_through_the_replay_endpoint(replay_topic):
    """Both replay forms: vLLM 0.32 (vllm/distributed/kv_events.py _service_replay) sends
    (client_id, b"", topic, seq, payload) per batch and (client_id, b"", b"", END_SEQ, b"") at
    the end, one frame more than the older form; a real vLLM's replay was read as nothing."""
    async def scenario(context, publisher, stream_for):
        publisher.replay_topic = replay_topic
        index = KVIndex()
        stream = await stream_for(index)
        await publisher.send(0, batch(stored(1, 2)))
        await publisher.send(1, batch(removed(2)), keep=True)
        publisher.kept[1] = batch(removed(2))
        await until(lambda: stream.stats.batches == 2)
        publisher.kept[2] = batch(stored(7))  # published but lost on the way
        await publisher.send(3, batch(stored(8)))
        await until(lambda: stream.stats.batches == 4)
        assert publisher.replays == [2] and stream.stats.gaps == 1 and stream.stats.resyncs == 1
        assert index.longest_prefix([1], ["engine-a"]) == {"engine-a": 1}
        assert index.blocks_of("engine-a") == 3  # 1, 7 (replayed), 8
    run(scenario)


def held(index: KVIndex, block: int) -> bool:
    """Whether the index says engine-a holds this block."""
    return index.longest_prefix([block], ["engine-a"]).get("engine-a", 0) == 1


# A replay either ends with its end marker or stops answering (REPLAY_TIMEOUT_S per message,
# shortened here): each way, what it brought must be applied the same way.
REPLAY_ENDINGS = [pytest.param(True, id="end-marker"), pytest.param(False, id="timeout")]


@pytest.mark.parametrize("ends", REPLAY_ENDINGS)
def test_a_replay_applies_each_batch_from_its_start_once_and_in_order(ends, monkeypatch):
    """A replay endpoint that sends more than asked (a batch before the start), twice, or out of
    order: only the batches from the start on count, each once, in sequence order. Applied as
    sent, the old store of 2 (since removed) or the second copy of the store of 7 (removed after
    it) would claim a block the engine no longer holds."""
    monkeypatch.setattr(kv_events, "REPLAY_TIMEOUT_S", 1.0)

    async def scenario(context, publisher, stream_for):
        index = KVIndex()
        stream = await stream_for(index)
        await publisher.send(0, batch(stored(1, 2)))
        await publisher.send(1, batch(removed(2)))
        await until(lambda: stream.stats.batches == 2)
        publisher.replay_ends = ends
        publisher.replay_script = [(3, batch(removed(7))), (0, batch(stored(1, 2))), (2, batch(stored(7))),
                                   (4, batch(stored(9))), (2, batch(stored(7)))]
        await publisher.send(4, batch(stored(9)))  # 2 and 3 were lost on the way
        await until(lambda: stream.stats.batches >= 5)
        await publisher.send(5, batch(stored(10)))  # the stream goes on from 5
        await until(lambda: held(index, 10))
        assert stream.stats.batches == 6  # 0, 1, then 2, 3, 4 replayed (the live 4 is not news), 5
        assert publisher.replays == [2] and stream.stats.resyncs == 1 and stream.stats.forgotten == 0
        assert [h for h in (1, 2, 7, 9, 10) if held(index, h)] == [1, 9, 10]
        assert index.blocks_of("engine-a") == 3
    run(scenario)


@pytest.mark.parametrize("ends", REPLAY_ENDINGS)
@pytest.mark.parametrize("replayed,missed", [
    pytest.param([1, 3], "2..2", id="a-hole"),
    pytest.param([1, 2], "3..3", id="stopping-short"),
])
def test_a_replay_that_skips_a_batch_forgets_the_deployment(ends, replayed, missed, monkeypatch, caplog):
    """A replay with a hole in it, or one that stops before the batch that asked for it: the batch
    it did not bring may have removed any block, so the deployment's blocks are forgotten there,
    and only what follows counts."""
    monkeypatch.setattr(kv_events, "REPLAY_TIMEOUT_S", 1.0)

    async def scenario(context, publisher, stream_for):
        index = KVIndex()
        stream = await stream_for(index)
        await publisher.send(0, batch(stored(1)))
        await until(lambda: stream.stats.batches == 1)
        publisher.replay_ends = ends
        publisher.replay_script = [(seq, batch(stored(100 + seq))) for seq in replayed]
        await publisher.send(4, batch(stored(8)))
        await until(lambda: stream.stats.batches == 4)
        assert stream.stats.forgotten == 1 and not held(index, 1)
        after = [100 + seq for seq in replayed if seq > int(missed.split("..")[0])] + [8]
        assert index.blocks_of("engine-a") == len(after)
        assert all(held(index, h) for h in after)
    with caplog.at_level(logging.WARNING, "kvgate.kv_events"):
        run(scenario)
    assert any("engine-a" in r.message and f"batches {missed} were missed" in r.message for r in caplog.records)


def test_a_gap_without_replay_forgets_the_deployment_rather_than_keep_stale_blocks(caplog):
    async def scenario(context, publisher, stream_for):
        index = KVIndex()
        index.stored("engine-b", [1])
        stream = await stream_for(index, replay=False)
        await publisher.send(0, batch(stored(1, 2)))
        await until(lambda: stream.stats.batches == 1)
        await publisher.send(5, batch(stored(9)))  # 1..4 were lost: any of them may have evicted 1 or 2
        await until(lambda: stream.stats.batches == 2)
        assert index.blocks_of("engine-a") == 1 and index.longest_prefix([9], ["engine-a"]) == {"engine-a": 1}
        assert index.blocks_of("engine-b") == 1  # another deployment's blocks are untouched
    with caplog.at_level(logging.WARNING, "kvgate.kv_events"):
        run(scenario)
    assert any("engine-a" in r.message and "batches 1..4 were missed" in r.message for r in caplog.records)


def test_live_copies_of_what_a_replay_brought_are_ignored():
    """A replay reaches past the live batch that asked for it; the live copies of those batches
    that follow are no news (counted), not a restart, and a late store does not revive a block."""
    async def scenario(context, publisher, stream_for):
        index = KVIndex()
        stream = await stream_for(index)
        await publisher.send(0, batch(stored(1)))
        await until(lambda: stream.stats.batches == 1)
        publisher.kept.update({1: batch(stored(2)), 2: batch(removed(2))})  # lost on the way
        publisher.kept.update({4: batch(stored(5)), 5: batch(stored(6))})  # published during the replay
        await publisher.send(3, batch(stored(4)))
        await until(lambda: stream.stats.batches == 6)
        for seq in (4, 5):
            await publisher.send(seq, publisher.kept[seq])
        await publisher.send(6, batch(stored(7)))
        await until(lambda: held(index, 7))
        assert stream.stats.out_of_order == 2 and stream.stats.restarts == 0 and stream.stats.forgotten == 0
        assert [h for h in range(1, 8) if held(index, h)] == [1, 4, 5, 6, 7]
    run(scenario)


@pytest.mark.parametrize("replay", [False, True])
def test_a_publisher_restarted_a_few_seqs_behind_starts_the_deployment_over(replay, caplog):
    """An engine restarts while the gateway keeps listening and misses its first batches (a
    subscription travels after the reconnect): its seq is a little behind the expected one, not 0.
    The old engine's blocks are forgotten; the new stream is taken from there, with what the replay
    endpoint still holds of it."""
    async def scenario(context, publisher, stream_for):
        index = KVIndex()
        stream = await stream_for(index, replay=replay)
        for seq in range(10):
            await publisher.send(seq, batch(stored(10 + seq)))
        await until(lambda: stream.stats.batches == 10)
        publisher.kept = {0: batch(CLEARED), 1: batch(stored(60)), 2: batch(stored(61))}  # the new engine's
        await publisher.send(3, batch(stored(62)))
        await until(lambda: held(index, 62))
        await publisher.send(4, batch(stored(63)))
        await until(lambda: held(index, 63))
        assert stream.stats.restarts == 1 and stream.stats.out_of_order == 0
        assert [h for h in range(10, 20) if held(index, h)] == []
        assert [h for h in (60, 61, 62, 63) if held(index, h)] == ([60, 61, 62, 63] if replay else [62, 63])
        assert publisher.replays == ([0] if replay else [])
    with caplog.at_level(logging.WARNING, "kvgate.kv_events"):
        run(scenario)
    assert any("engine-a" in r.message and "publisher restarted (seq 3 after 9)" in r.message for r in caplog.records)


def test_a_publisher_restarted_just_after_a_replay_is_told_by_its_batches():
    """Right after a replay that reached past its live batch, a new publisher's seq can land
    among the replayed ones: its batch is not the one replayed there, so it is a restart."""
    async def scenario(context, publisher, stream_for):
        index = KVIndex()
        stream = await stream_for(index)
        await publisher.send(0, batch(stored(1)))
        await until(lambda: stream.stats.batches == 1)
        publisher.kept.update({1: batch(stored(2)), 3: batch(stored(4)), 4: batch(stored(5))})
        await publisher.send(2, batch(stored(3)))
        await until(lambda: stream.stats.batches == 5)
        publisher.kept = {}  # a new engine, whose batches 0..2 did not reach us
        await publisher.send(3, batch(stored(70)))
        await until(lambda: held(index, 70))
        assert stream.stats.restarts == 1 and [h for h in (1, 2, 3, 4, 5, 70) if held(index, h)] == [70]
    run(scenario)


def test_a_restarted_publisher_starts_the_deployment_over():
    async def scenario(context, publisher, stream_for):
        index = KVIndex()
        stream = await stream_for(index, replay=False)
        for seq in range(3):
            await publisher.send(seq, batch(stored(10 + seq)))
        await until(lambda: stream.stats.batches == 3)
        await publisher.send(0, batch(CLEARED))  # a new engine: its cache is empty
        await publisher.send(1, batch(stored(50)))
        await until(lambda: stream.stats.batches == 5)
        assert stream.stats.restarts == 1 and index.blocks_of("engine-a") == 1
        assert index.longest_prefix([50], ["engine-a"]) == {"engine-a": 1}
    run(scenario)


def test_garbage_frames_are_counted_named_and_survived(caplog):
    async def scenario(context, publisher, stream_for):
        index = KVIndex()
        stream = await stream_for(index, replay=False)
        await publisher.send(0, batch(stored(1)))
        await publisher.pub.send_multipart([b"kv", b"no seq"])  # two frames
        await publisher.pub.send_multipart([b"kv", b"\x00\x01", b"x"])  # a 2-byte seq
        await publisher.send(1, b"\xc1 not msgpack")  # its batch is lost: forget
        await publisher.send(2, batch(stored(2)))
        await until(lambda: stream.stats.batches == 2)
        assert stream.stats.garbage == 3 and stream.live
        assert index.blocks_of("engine-a") == 1 and index.longest_prefix([2], ["engine-a"]) == {"engine-a": 1}
    with caplog.at_level(logging.WARNING, "kvgate.kv_events"):
        run(scenario)
    assert any("engine-a" in r.message and "not KV event batches" in r.message for r in caplog.records)


def test_a_flood_stays_within_the_bound_and_the_loop_keeps_serving():
    async def scenario(context, publisher, stream_for):
        index = KVIndex(max_blocks=500)
        stream = await stream_for(index, replay=False)
        ticks = 0

        async def other_work():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)
        worker = asyncio.get_running_loop().create_task(other_work())
        for seq in range(3000):
            await publisher.send(seq, batch(stored(*range(seq * 4, seq * 4 + 4))), keep=False)
        await until(lambda: stream.stats.batches + stream.stats.gaps >= 1 and
                    index.longest_prefix([2999 * 4], ["engine-a"]) == {"engine-a": 1}, timeout_s=30)
        worker.cancel()
        assert len(index) <= 500 and index.blocks_of("engine-a") == len(index)
        assert ticks > 3000 // 64  # the subscriber yielded to other tasks while it applied the flood
    run(scenario)


def test_a_message_over_the_size_bound_is_never_read(monkeypatch):
    """zmq.MAXMSGSIZE (2 MiB): a 2.6 MB batch of 64,000 hashes (under the hash cap) is dropped by
    the socket with its connection, never decoded; libzmq does not reconnect after that, so the
    subscriber connects afresh (REVIVE_AFTER_S) and the next batches are read."""
    monkeypatch.setattr(kv_events, "REVIVE_AFTER_S", 0.3)

    async def scenario(context, publisher, stream_for):
        index = KVIndex()
        stream = await stream_for(index, replay=False)
        big = batch(stored(*[i.to_bytes(8, "big") * 5 for i in range(1, 64_001)]))
        assert len(big) > 2 << 20
        await publisher.send(0, big)
        seq = 0
        while stream.stats.batches == 0:  # until the reconnected subscription hears one (no replay: a gap is forgotten)
            seq += 1
            assert seq < 500, f"no batch after the big one: {stream.stats} {stream.connected}"
            await publisher.send(seq, batch(stored(70_000 + seq)))
            await asyncio.sleep(0.02)
        assert index.longest_prefix([int.from_bytes((1).to_bytes(8, "big") * 5, "big") & (2**64 - 1)],
                                    ["engine-a"]) == {"engine-a": 0}
        assert index.blocks_of("engine-a") <= seq
    run(scenario)


def test_a_large_batch_is_applied_in_pieces_between_which_the_loop_serves_others(monkeypatch):
    """60,000 hashes in one batch reach the index in pieces of at most 4,096, and other tasks run
    between the pieces (one call for the whole batch held the loop: 1.2 M hashes, 4.1 s)."""
    async def scenario(context, publisher, stream_for):
        index = KVIndex()
        stream = await stream_for(index, replay=False)
        ticks, seen = 0, []
        real = index.stored

        def stored_in_pieces(deployment, hashes):
            seen.append((len(hashes), ticks))
            real(deployment, hashes)
        monkeypatch.setattr(index, "stored", stored_in_pieces)

        async def other_work():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)
        worker = asyncio.get_running_loop().create_task(other_work())
        await publisher.send(0, batch(stored(*range(1, 60_001))))
        await until(lambda: stream.stats.batches == 1, timeout_s=30)
        worker.cancel()
        assert sum(n for n, _ in seen) == 60_000 and max(n for n, _ in seen) <= 4096
        assert all(a[1] < b[1] for a, b in zip(seen, seen[1:]))  # the worker ran between every two pieces
    run(scenario)


def test_a_replay_that_never_ends_is_cut_at_its_bound(monkeypatch, caplog):
    monkeypatch.setattr(kv_events, "MAX_REPLAY_BATCHES", 5)

    async def scenario(context, publisher, stream_for):
        for seq in range(20):  # published before the subscriber came: only the replay has them
            publisher.kept[seq] = batch(stored(seq + 1))
        publisher.replay_ends = False
        index = KVIndex()
        stream = await stream_for(index)
        await publisher.send(20, batch(stored(21)))
        await until(lambda: stream.stats.batches == 6)  # 5 replayed, then the live one
        assert index.longest_prefix([1], ["engine-a"]) == {"engine-a": 0}  # forgotten: 5..19 were not read
        assert index.longest_prefix([21], ["engine-a"]) == {"engine-a": 1}
    with caplog.at_level(logging.WARNING, "kvgate.kv_events"):
        run(scenario)
    assert any("passed 5 batches; stopped there" in r.message for r in caplog.records)


def test_a_publisher_that_goes_away_is_no_longer_live(caplog):
    async def scenario(context, publisher, stream_for):
        index = KVIndex()
        stream = await stream_for(index)
        await publisher.send(0, batch(stored(1)))
        await until(lambda: stream.live)
        publisher.close()
        await until(lambda: not stream.live)
        assert index.blocks_of("engine-a") == 1  # kept: a restart (seq 0 again) or a gap decides
    with caplog.at_level(logging.WARNING, "kvgate.kv_events"):
        run(scenario)
    assert any("engine-a" in r.message and "went away" in r.message for r in caplog.records)


def test_the_engines_publisher_feeds_the_index_and_a_late_subscriber_catches_up_by_replay():
    async def main():
        # Ports the sockets pick as they bind (a port found free first can be taken before use).
        publisher = KVEventPublisher(KVEventsOptions(endpoint="tcp://127.0.0.1:*",
                                                     replay_endpoint="tcp://127.0.0.1:*", topic="kv@x"))
        port, replay_port = (int(e.rsplit(":", 1)[1]) for e in (publisher.bound_endpoint,
                                                                 publisher.bound_replay_endpoint))
        context = zmq.asyncio.Context()
        index = KVIndex()
        publisher.publish([core.AllBlocksCleared()])
        publisher.publish([core.BlockStored((11, 12), None, tuple(range(8)), 4)])  # before anyone listens
        await asyncio.sleep(0.2)
        source = KVEventsSource(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay_port}", topic="kv@")
        stream = EventStream("native-0", source, index, context)
        stream.start()
        try:
            await until(lambda: stream.connected)
            await asyncio.sleep(0.2)
            publisher.publish([core.BlockStored((13,), 12, tuple(range(8, 12)), 4), core.BlockRemoved([11])])
            await until(lambda: stream.stats.batches == 3, 3)
            assert stream.stats.resyncs == 1  # batches 0 and 1 came from the replay
            assert index.longest_prefix([11, 12, 13], ["native-0"]) == {"native-0": 0}
            assert index.blocks_of("native-0") == 2
        finally:
            await stream.close()
            context.term()
            publisher.close()
    asyncio.run(main())


def test_an_address_that_cannot_be_bound_leaves_no_socket_open():
    async def scenario():
        context = zmq.asyncio.Context()
        taken = context.socket(zmq.PUB)
        endpoint = f"tcp://127.0.0.1:{bind_any_port(taken)}"
        stream = EventStream("engine-a", KVEventsSource(endpoint, bind=True), KVIndex(), context)
        with pytest.raises(zmq.ZMQError):
            stream.start()
        assert len(context._sockets) == 1  # only `taken`: the subscriber and its monitor were closed
        await stream.close()  # closing what never started is harmless
        taken.close(linger=0)
        context.destroy(linger=0)

    asyncio.run(scenario())
