"""KV events from our engine, read the way any vLLM KV-event subscriber reads them.

The hashes are checked against a sha256-of-canonical-CBOR computation written here from vLLM's
recipe (a hand-made CBOR encoder, not cbor2), and the wire against a plain pyzmq SUB + REQ and
msgspec's schema-less msgpack decoder: nothing of the publisher's own code is used to read.
"""

from __future__ import annotations

import hashlib
import ipaddress
import socket
import time

import msgspec
import pytest
import zmq

from native_backend.config.engine import EngineConfig, KVEventsOptions
from native_backend.core.block_manager import BlockManager
from native_backend.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from native_backend.core.sequence import Sequence
from native_backend.process.kv_publisher import KVEventPublisher


# --- an independent sha256_cbor, from the recipe ------------------------------------------

def _cbor_head(major: int, n: int) -> bytes:
    if n < 24:
        return bytes([major << 5 | n])
    for extra, size in ((24, 1), (25, 2), (26, 4), (27, 8)):
        if n < 1 << (8 * size):
            return bytes([major << 5 | extra]) + n.to_bytes(size, "big")
    raise ValueError(n)


def cbor(value) -> bytes:
    """Canonical CBOR of None, non-negative ints, text, bytes and arrays (all the recipe uses)."""
    if value is None:
        return b"\xf6"
    if isinstance(value, int):
        return _cbor_head(0, value)
    if isinstance(value, str):
        return _cbor_head(3, len(value.encode())) + value.encode()
    if isinstance(value, bytes):
        return _cbor_head(2, len(value)) + value
    return _cbor_head(4, len(value)) + b"".join(cbor(v) for v in value)


def recipe_hashes(tokens: list[int], block_size: int, seed: str, salt: str | None = None) -> list[int]:
    """vLLM v1 block hashes with sha256_cbor and PYTHONHASHSEED=seed, as published (low 64 bits);
    a cache_salt is the first block's extra keys, [["cache_salt", salt]] (vLLM 0.32's
    generate_block_hash_extra_keys)."""
    parent = hashlib.sha256(cbor(seed)).digest()
    out = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        extra = [["cache_salt", salt]] if start == 0 and salt else None
        parent = hashlib.sha256(cbor([parent, tokens[start:start + block_size], extra])).digest()
        out.append(int.from_bytes(parent[-8:], "big"))
    return out


def test_cbor_encoder_matches_known_vectors():
    assert cbor("0").hex() == "6130"
    assert cbor([b"\x01", [1, 500], None]).hex() == "834101820119" + "01f4" + "f6"


# --- the block manager's hashes and events --------------------------------------------------

def compute_all(bm: BlockManager, seq: Sequence) -> None:
    cached = bm.get_computed_prefix(seq)
    bm.allocate_slots(seq, seq.num_tokens - cached, cached)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_full_blocks(seq)


@pytest.mark.parametrize("seed", ["0", "1234"])
def test_stored_blocks_carry_vllm_sha256_cbor_hashes(seed):
    bm = BlockManager(num_blocks=16, block_size=4, hash_seed=seed, record_kv_events=True)
    tokens = [7, 300, 70000, 5, 9, 9, 9, 1, 2, 3, 4, 5, 6, 7]  # ints of 1, 2 and 4 CBOR bytes
    compute_all(bm, Sequence("a", tokens))
    events = bm.take_kv_events()
    assert events[0] == AllBlocksCleared()
    assert events[1] == BlockStored(tuple(recipe_hashes(tokens, 4, seed)), None, tuple(tokens[:12]), 4)
    assert bm.take_kv_events() == []


def test_a_cache_salt_enters_the_first_blocks_hash_as_vllm_mixes_it():
    """Issue 40 item 4: the salt is the first block's extra key, so every hash of a salted prompt
    differs from the unsalted one's and from another salt's; the events carry the salted hashes
    (a router indexes each salt's prefixes apart)."""
    tokens = list(range(100, 114))
    hashes = {}
    for salt in (None, "tenant-a", "tenant-b"):
        bm = BlockManager(num_blocks=16, block_size=4, hash_seed="0", record_kv_events=True)
        compute_all(bm, Sequence("a", tokens, cache_salt=salt))
        [_, stored] = bm.take_kv_events()
        assert stored.block_hashes == tuple(recipe_hashes(tokens, 4, "0", salt)), salt
        hashes[salt] = set(stored.block_hashes)
    assert not hashes[None] & hashes["tenant-a"] and not hashes["tenant-a"] & hashes["tenant-b"]


def test_a_continuation_chains_to_its_parent_and_hits_share_no_new_event():
    bm = BlockManager(num_blocks=16, block_size=4, record_kv_events=True)
    compute_all(bm, Sequence("a", list(range(9))))
    bm.take_kv_events()
    longer = list(range(13))
    compute_all(bm, Sequence("b", longer))  # blocks 0, 1 hit; block 2 is new
    expected = recipe_hashes(longer, 4, "0")
    assert bm.take_kv_events() == [BlockStored((expected[2],), expected[1], tuple(range(8, 12)), 4)]


def test_evictions_are_reported_as_removed():
    bm = BlockManager(num_blocks=3, block_size=4, record_kv_events=True)
    first = Sequence("a", list(range(9)))
    compute_all(bm, first)
    bm.free(first)  # both hashed blocks wait in the LRU, still cached
    bm.take_kv_events()
    compute_all(bm, Sequence("b", [50 + t for t in range(9)]))  # needs all 3 blocks: evicts both
    removed, stored = bm.take_kv_events()
    h0, h1 = recipe_hashes(list(range(9)), 4, "0")
    assert removed == BlockRemoved([h1, h0])  # a sequence's tail is evicted before its prefix
    assert stored.block_hashes == tuple(recipe_hashes([50 + t for t in range(9)], 4, "0"))


def test_a_prefix_cache_reset_forgets_every_prefix_and_says_all_blocks_cleared():
    bm = BlockManager(num_blocks=8, block_size=4, record_kv_events=True)
    done, running = Sequence("a", list(range(9))), Sequence("b", [50 + t for t in range(9)])
    compute_all(bm, done)
    bm.free(done)  # cached, free
    compute_all(bm, running)  # cached, in use
    bm.take_kv_events()
    bm.reset_prefix_cache()
    assert bm.take_kv_events() == [AllBlocksCleared()]
    assert bm.get_computed_prefix(Sequence("a2", list(range(9)))) == 0
    assert bm.get_computed_prefix(Sequence("b2", [50 + t for t in range(9)])) == 0
    assert bm.num_free_blocks == 8 - len(running.block_table) and bm.num_cached_free_blocks == 0
    bm.free(running)  # its blocks, unhashed now, return as plain free blocks
    assert bm.num_free_blocks == 8 and bm.num_cached_free_blocks == 0
    compute_all(bm, Sequence("c", list(range(9))))  # cached anew, and announced anew
    assert [e.block_hashes for e in bm.take_kv_events()] == [tuple(recipe_hashes(list(range(9)), 4, "0"))]


def test_nothing_is_kept_when_not_recording():
    bm = BlockManager(num_blocks=8, block_size=4)
    compute_all(bm, Sequence("a", list(range(9))))
    assert bm.take_kv_events() == []


# --- the wire ------------------------------------------------------------------------------

def decode_event(raw) -> tuple[str, dict]:
    """An event in either form vLLM has used: a map with "type", or a positional array."""
    if isinstance(raw, dict):
        return raw["type"], raw
    names = {"BlockStored": ["block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id"],
             "BlockRemoved": ["block_hashes"], "AllBlocksCleared": []}[raw[0]]
    return raw[0], dict(zip(names, raw[1:]))


def decode_batch(payload: bytes) -> list[tuple[str, dict]]:
    batch = msgspec.msgpack.decode(payload)
    events = batch["events"] if isinstance(batch, dict) else batch[1]
    return [decode_event(e) for e in events]


@pytest.fixture
def zmq_context():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def receive(sub: zmq.Socket, timeout_s: float = 5.0) -> list[bytes]:
    assert sub.poll(int(timeout_s * 1000)), "no KV event batch arrived"
    return sub.recv_multipart()


def subscriber(context, endpoint: str, topic: bytes) -> zmq.Socket:
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    sub.connect(endpoint)
    return sub


def replay(context, endpoint: str, start: int) -> list[tuple[int, list]]:
    """Ask for every buffered batch from `start` on (a DEALER with REQ's empty delimiter), until
    the end marker: seq -1 as a signed 8-byte integer."""
    dealer = context.socket(zmq.DEALER)
    dealer.connect(endpoint)
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    batches = []
    while True:
        assert dealer.poll(5000), "the replay endpoint did not answer"
        _, seq, payload = dealer.recv_multipart()
        if int.from_bytes(seq, "big", signed=True) == -1:
            dealer.close()
            return batches
        batches.append((int.from_bytes(seq, "big"), decode_batch(payload)))


def test_batches_arrive_as_three_frames_with_consecutive_sequence_numbers(zmq_context):
    # any free ports, bound by the publisher itself (a port picked beforehand can be taken meanwhile)
    publisher = KVEventPublisher(KVEventsOptions(endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*",
                                                 topic="kv@e1", publish_token_ids=True))
    at, replay_at = publisher.bound_endpoint, publisher.bound_replay_endpoint
    try:
        sub = subscriber(zmq_context, at, b"kv@")
        time.sleep(0.3)  # a PUB drops what it sends before the subscription has arrived
        publisher.publish([AllBlocksCleared()])
        publisher.publish([BlockStored((1, 2**64 - 1), None, tuple(range(8)), 4), BlockRemoved([5])])
        first, second = receive(sub), receive(sub)
        assert [len(first), first[0], int.from_bytes(first[1], "big")] == [3, b"kv@e1", 0]
        assert int.from_bytes(second[1], "big") == 1
        assert decode_batch(first[2]) == [("AllBlocksCleared", {"type": "AllBlocksCleared"})]
        (stored_type, stored), (removed_type, removed) = decode_batch(second[2])
        assert (stored_type, removed_type) == ("BlockStored", "BlockRemoved")
        assert stored["block_hashes"] == [1, 2**64 - 1] and stored["parent_block_hash"] is None
        assert stored["token_ids"] == list(range(8)) and stored["block_size"] == 4
        assert removed["block_hashes"] == [5]
        assert isinstance(msgspec.msgpack.decode(second[2])["ts"], float)

        assert replay(zmq_context, replay_at, 1) == [(1, decode_batch(second[2]))]
        assert [seq for seq, _ in replay(zmq_context, replay_at, 0)] == [0, 1]
    finally:
        publisher.close()


def loopback_only(endpoint: str) -> bool:
    """Whether a bound ZMQ tcp endpoint (its LAST_ENDPOINT) listens on a loopback address alone."""
    host = endpoint.removeprefix("tcp://").rsplit(":", 1)[0].strip("[]")
    return ipaddress.ip_address(host).is_loopback


def test_by_default_the_publisher_and_its_replay_listen_on_loopback_alone(zmq_context):
    """Issue 40 item 1: KV events name every tenant's cached prefixes; the default endpoint is
    bound on loopback (vLLM's default, tcp://*:5557, listens on every interface), and a loopback
    replay endpoint is bound there too."""
    default = KVEventsOptions().endpoint
    port = int(default.rsplit(":", 1)[1])
    with socket.socket() as probe:  # the default's own port, unless another process has it
        if probe.connect_ex(("127.0.0.1", port)) == 0:
            pytest.skip(f"port {port} of the default endpoint is taken here")
    publisher = KVEventPublisher(KVEventsOptions(replay_endpoint="tcp://127.0.0.1:*"))
    try:
        pub_at, replay_at = publisher.bound_endpoint, publisher.bound_replay_endpoint
        assert loopback_only(pub_at) and loopback_only(replay_at), (pub_at, replay_at)
        sub = subscriber(zmq_context, f"tcp://127.0.0.1:{port}", b"")
        time.sleep(0.3)  # a PUB drops what it sends before the subscription has arrived
        publisher.publish([AllBlocksCleared()])
        assert decode_batch(receive(sub)[2]) == [("AllBlocksCleared", {"type": "AllBlocksCleared"})]
    finally:
        publisher.close()


def first_batch(context, endpoint: str, publisher: KVEventPublisher, tries: int = 50) -> list[bytes]:
    """Publish until a subscriber of `endpoint` has a batch (a PUB drops what it sends before the
    subscription has arrived): the listener works, whatever the timing."""
    sub = subscriber(context, endpoint, b"")
    for _ in range(tries):
        publisher.publish([AllBlocksCleared()])
        if sub.poll(100):
            return sub.recv_multipart()
    raise AssertionError(f"no KV event batch arrived from {endpoint}")


def test_an_address_of_this_machine_is_bound_and_a_remote_one_connected_to(zmq_context):
    """A pod's own IP (the Helm chart's endpoints, tcp://<pod IP>:port) is bound there alone, so
    the gateway reaches the publisher and other interfaces do not; an address of another machine
    stays vLLM's connect, for a subscriber that binds."""
    from native_backend.process.kv_publisher import binds
    from tests.support.checks.host_addresses import own_ipv4_addresses

    own = own_ipv4_addresses()
    if not own:
        pytest.skip("this machine has no IPv4 address besides loopback (/proc/net/fib_trie)")
    assert binds(f"tcp://{own[0]}:5557")  # (a port of "*" is bound whatever the host)
    publisher = KVEventPublisher(KVEventsOptions(endpoint=f"tcp://{own[0]}:*", replay_endpoint=f"tcp://{own[0]}:*"))
    try:
        at = publisher.bound_endpoint
        assert at.removeprefix("tcp://").rsplit(":", 1)[0] == own[0], at
        assert first_batch(zmq_context, at, publisher)[0] == b""
    finally:
        publisher.close()
    remote = next(a for a in ("203.0.113.7", "198.51.100.7") if a not in own)  # TEST-NET-3 / -2
    assert not binds(f"tcp://{remote}:5557") and not binds("tcp://engine-0.engines:5557")


@pytest.mark.parametrize("asked", [False, True])
def test_stored_blocks_carry_their_tokens_only_when_a_setting_asks(zmq_context, asked):
    """The prompts' token ids stay in the engine unless kv_events.publish_token_ids: a subscriber
    (anyone who reaches the port) otherwise reads every tenant's prompt off the feed."""
    publisher = KVEventPublisher(KVEventsOptions(endpoint="tcp://127.0.0.1:*", publish_token_ids=asked))
    try:
        sub = subscriber(zmq_context, publisher.bound_endpoint, b"")
        time.sleep(0.3)
        secret = tuple(range(100, 108))
        publisher.publish([BlockStored((7, 8), None, secret, 4)])
        [(kind, stored)] = decode_batch(receive(sub)[2])
        assert kind == "BlockStored" and stored["block_hashes"] == [7, 8]
        assert stored["token_ids"] == (list(secret) if asked else [])
    finally:
        publisher.close()


# --- the engine ----------------------------------------------------------------------------

def test_the_real_engine_publishes_its_prompt_blocks_with_recipe_hashes(tmp_path, zmq_context):
    from native_backend.core.interface import EngineRequest
    from native_backend.core.sampling_params import SamplingParams
    from native_backend.model.loader import default_gguf_path
    from native_backend.process.factory import make_engine_core

    config = EngineConfig.build(path=default_gguf_path(), tokenizer_cache_dir=str(tmp_path), num_threads=1,
                                block_size=16, prefix_hash_seed="42",
                                kv_events={"endpoint": "tcp://127.0.0.1:*", "topic": "kv@smol"})
    engine = make_engine_core(config)  # its publisher binds a free port and says which
    try:
        sub = subscriber(zmq_context, engine.core._kv_events.__self__.bound_endpoint, b"")
        prompt = engine.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 8)
        time.sleep(0.3)  # the subscription reaches the PUB before the request's events
        engine.add_request(EngineRequest("r1", prompt, SamplingParams(max_tokens=2, temperature=0.0)))
        while engine.has_unfinished():
            engine.step()
        stored = []
        while sub.poll(1000):
            topic, _, payload = sub.recv_multipart()
            assert topic == b"kv@smol"
            stored += [e["block_hashes"] for kind, e in decode_batch(payload) if kind == "BlockStored"]
        hashes = [h for run in stored for h in run]
        expected = recipe_hashes(prompt, 16, "42")
        assert expected and hashes[:len(expected)] == expected
    finally:
        engine.core._kv_events.__self__.close()  # the factory's publisher: its port and thread


def test_the_replay_endpoint_differs_from_the_publishers_unless_both_ask_for_any_port():
    with pytest.raises(ValueError, match="must differ"):
        KVEventsOptions(endpoint="tcp://127.0.0.1:5557", replay_endpoint="tcp://127.0.0.1:5557")
    options = KVEventsOptions(endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*")
    publisher = KVEventPublisher(options)
    try:
        assert publisher.bound_endpoint != publisher.bound_replay_endpoint  # two ports the system chose
        assert not publisher.bound_endpoint.endswith(":*")
    finally:
        publisher.close()
