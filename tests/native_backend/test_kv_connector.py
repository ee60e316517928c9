"""Prefill/decode disaggregation inside the engine: a producer engine and a consumer engine (real
engine cores, real TCP on loopback, a tiny random Llama), against one engine serving the same
request alone.

Greedy tokens of a request whose prompt KV was computed by the producer and read by the consumer
are the solo engine's, for every KV format (fp32, bf16, fp8 with its scales, int8 with its row
scales); stale, forged and broken reads end in a recompute (counted), never in foreign KV; a read
in flight never stalls the consumer's batch; every block comes back on both sides.
"""

import contextlib
import ipaddress
import json
import multiprocessing
import os
import shutil
import signal
import socket
import threading
import time

import pytest
import tokenizers
import torch

from native_backend.config.engine import EngineConfig
from native_backend.core.engine import LLMEngine
from native_backend.core.interface import EngineError, EngineRequest
from native_backend.core.kv_connector import HeldBlocks
from native_backend.core.sampling_params import SamplingParams
from native_backend.core.sequence import Sequence
from native_backend.execution import kv_scales
from native_backend.execution.executor import InProcessExecutor
from native_backend.execution.kv_transfer.connector import make_kv_transfer
from native_backend.execution.kv_transfer.trust import ProducerAllowList
from native_backend.execution.kv_transfer.wire import recv_header
from tests.support.checks.kv_connector_checks import all_blocks_back, finish, run
from tests.support.data.llama_checkpoints import VOCAB, make_checkpoint

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PREFILL = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
BLOCK = 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    make_checkpoint(path, tie=False, rope_scaling=None)
    return str(path)


def build_engine(checkpoint: str, role, kv_cache_dtype="auto", **settings) -> LLMEngine:
    config = EngineConfig.build(path=checkpoint, kv_cache_bytes=2 << 20, block_size=BLOCK, kv_role=role,
                                max_num_batched_tokens=16, kv_cache_dtype=kv_cache_dtype, kv_scales="unit", **settings)
    executor = InProcessExecutor(config)
    return LLMEngine(config, executor, kv_transfer=make_kv_transfer(config.transfer, executor.kv_cache))


@pytest.fixture(scope="module")
def make_engine(checkpoint):
    engines = []

    def make(role, kv_cache_dtype="auto", **settings):
        engines.append(build_engine(checkpoint, role, kv_cache_dtype, **settings))
        return engines[-1]

    yield make
    for engine in engines:
        if engine.kv is not None:
            engine.kv.port.close()


def prompt(seed: int, length: int = 37) -> list[int]:
    return torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def prefill(producer, request_id: str, ids: list[int]) -> dict:
    _, last = run(producer, EngineRequest(request_id, ids, PREFILL, kv_transfer_params={"do_remote_decode": True}))
    assert last.finish_reason == "length"
    return last.kv_transfer_params


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "bfloat16", "fp8_e4m3", "int8"])
def test_a_request_decoded_from_the_producers_blocks_gives_the_solo_engines_tokens(make_engine, kv_cache_dtype):
    producer, consumer, solo = (make_engine(role, kv_cache_dtype) for role in ("producer", "consumer", None))
    ids = prompt(1)
    expected, _ = run(solo, EngineRequest("r", ids, GREEDY))
    params = prefill(producer, "r", ids)
    assert params["do_remote_prefill"] is True and params["remote_num_tokens"] == len(ids)
    assert params["remote_port"] == producer.kv.port.endpoint.port and params["tp_size"] == 1
    tokens, last = run(consumer, EngineRequest("r", ids, GREEDY, kv_transfer_params=params))
    assert tokens == expected
    assert last.timings["kv_transfer_tokens"] == (len(ids) - 1) // BLOCK * BLOCK  # whole blocks, the last token here
    # The read is used: 37 prompt tokens, 36 read (9 whole blocks), the last one computed here.
    assert last.timings["computed_prompt_tokens"] == 1
    stats = consumer.stats()
    assert (stats.kv_transfers, stats.kv_transfer_failures) == (1, 0)
    assert stats.kv_transfer_bytes == last.timings["kv_transfer_bytes"] > 0
    assert sum(stats.kv_transfer_bytes_histogram) == sum(stats.kv_transfer_seconds_histogram) == 1
    assert all_blocks_back(producer) and all_blocks_back(consumer)
    assert producer.stats().kv_transfers_served == 1  # counted as the hold is handed back


def build_calibrated_fp8_engine(checkpoint: str, role, offset_seed: int, **settings) -> LLMEngine:
    """An fp8 engine whose keys are stored minus a per-layer offset (KVLayer.k_offset), as a
    calibrated cache stores them; another seed stands for another calibration (or model file)."""
    config = EngineConfig.build(path=checkpoint, kv_cache_bytes=2 << 20, block_size=BLOCK, kv_role=role,
                                max_num_batched_tokens=16, kv_cache_dtype="fp8_e4m3", kv_scales="unit", **settings)
    executor = InProcessExecutor(config)
    cache = executor.kv_cache
    offsets = torch.randn(cache.num_layers, cache.num_kv_heads, cache.head_dim,
                          generator=torch.Generator().manual_seed(offset_seed))
    kv_scales.apply(cache, [(1.0, 1.0)] * cache.num_layers, offsets)
    return LLMEngine(config, executor, kv_transfer=make_kv_transfer(config.transfer, cache))


def test_a_consumer_with_a_separate_draft_model_drafts_from_its_own_kv_of_the_read_prompt(checkpoint, tmp_path):
    """The transfer fills the target's KV only; the draft's first pass computes its own KV of the
    whole prompt (drafter: catch-up from `_computed`, 0 for a new request). A draft equal to the
    target is then always accepted: draft KV left unwritten in the read blocks would not be."""
    shutil.copytree(checkpoint, tmp_path / "model")
    model = str(tmp_path / "model")
    word_level = tokenizers.models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0")
    tokenizers.Tokenizer(word_level).save(os.path.join(model, "tokenizer.json"))  # the draft check compares vocabs
    draft = dict(method="draft", draft_model=model, num_speculative_tokens=2, max_batch_size=None)
    engines = [build_engine(model, "producer"), build_engine(model, "consumer", speculative=draft),
               build_engine(model, None)]
    producer, consumer, solo = engines
    try:
        ids = prompt(21)
        params = prefill(producer, "d", ids)
        tokens, last = run(consumer, EngineRequest("d", ids, GREEDY, kv_transfer_params=params))
        assert last.timings["kv_transfer_tokens"] == (len(ids) - 1) // BLOCK * BLOCK
        assert last.timings["computed_prompt_tokens"] == 1  # of 37: the target ran the last token only
        assert tokens == run(solo, EngineRequest("d", ids, GREEDY))[0]
        stats = consumer.stats()
        assert (stats.kv_transfers, stats.kv_transfer_failures) == (1, 0)
        assert stats.spec_decode_num_draft_tokens > 0
        assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens
        assert all_blocks_back(consumer) and all_blocks_back(producer)
    finally:
        for engine in engines[:2]:
            engine.kv.port.close()


def test_fp8_engines_whose_key_offsets_differ_refuse_the_read_and_recompute(checkpoint):
    """Same dtype, shape and scales, other k_offsets: the bytes would mean other keys (issue 30)."""
    producer = build_calibrated_fp8_engine(checkpoint, "producer", offset_seed=1)
    consumer = build_calibrated_fp8_engine(checkpoint, "consumer", offset_seed=2, enable_prefix_caching=False)
    try:
        ids = prompt(15)
        expected, _ = run(consumer, EngineRequest("own", ids, GREEDY))  # its own prompt KV, its own offsets
        tokens, last = run(consumer, EngineRequest("o", ids, GREEDY, kv_transfer_params=prefill(producer, "o", ids)))
        assert last.timings.get("kv_transfer_failed") == 1
        assert last.timings["computed_prompt_tokens"] == 37  # all of it recomputed
        assert tokens == expected
        assert producer.stats().kv_transfers_refused == 1 and consumer.stats().kv_transfer_failures == 1
        producer.kv.held.evict_oldest()  # a refused read leaves the hold to its own timeout
        assert all_blocks_back(producer) and all_blocks_back(consumer)
    finally:
        producer.kv.port.close()
        consumer.kv.port.close()


def test_fp8_engines_with_the_same_key_offsets_share_blocks(checkpoint):
    producer = build_calibrated_fp8_engine(checkpoint, "producer", offset_seed=3)
    consumer = build_calibrated_fp8_engine(checkpoint, "consumer", offset_seed=3, enable_prefix_caching=False)
    try:
        ids = prompt(16)
        expected, _ = run(consumer, EngineRequest("own", ids, GREEDY))
        tokens, last = run(consumer, EngineRequest("s", ids, GREEDY, kv_transfer_params=prefill(producer, "s", ids)))
        assert tokens == expected and last.timings["kv_transfer_tokens"] > 0
        assert "kv_transfer_failed" not in last.timings
        assert last.timings["computed_prompt_tokens"] == 1  # 37 tokens, 36 read
    finally:
        producer.kv.port.close()
        consumer.kv.port.close()


@pytest.fixture(scope="module")
def pair(make_engine):
    """(producer, consumer, solo) in fp32, shared by the fault tests."""
    return make_engine("producer"), make_engine("consumer"), make_engine(None)


def forgeries(params: dict, other: dict) -> dict[str, dict]:
    return {
        "unknown request": {**params, "remote_request_id": "nobody"},
        "another engine's id": {**params, "remote_engine_id": "0" * 32},
        "block ids not its own": {**params, "remote_block_ids": [b + 1 for b in params["remote_block_ids"]]},
        "another request's blocks": {**other, "remote_request_id": params["remote_request_id"]},
    }


def test_stale_or_forged_params_recompute_and_never_read_foreign_blocks(make_engine, pair):
    producer, _, solo = pair
    consumer = make_engine("consumer", enable_prefix_caching=False)  # each read asks for every block
    ids, other_ids = prompt(2), prompt(3)
    expected, _ = run(solo, EngineRequest("f", ids, GREEDY))
    params, other = prefill(producer, "f", ids), prefill(producer, "g", other_ids)
    refused, failed = producer.stats().kv_transfers_refused, consumer.stats().kv_transfer_failures
    for n, (what, forged) in enumerate(forgeries(params, other).items()):
        tokens, last = run(consumer, EngineRequest(f"f{n}", ids, GREEDY, kv_transfer_params=forged))
        assert tokens == expected, what
        assert last.timings["kv_transfer_failed"] == 1, what
    assert producer.stats().kv_transfers_refused == refused + 4
    assert consumer.stats().kv_transfer_failures == failed + 4
    # A consumer whose prompt differs from the producer's asks for other hashes: refused, recomputed.
    tokens, last = run(consumer, EngineRequest("g2", prompt(4), GREEDY, kv_transfer_params=other))
    assert tokens == run(solo, EngineRequest("g2", prompt(4), GREEDY))[0] and last.timings["kv_transfer_failed"] == 1
    # The holds are still there for their own consumers, untouched by the forgeries.
    tokens, last = run(consumer, EngineRequest("f", ids, GREEDY, kv_transfer_params=params))
    assert tokens == expected and "kv_transfer_failed" not in last.timings
    producer.kv.held.evict_oldest()
    assert all_blocks_back(producer) and all_blocks_back(consumer)


@pytest.mark.parametrize("params, field", [
    ({"do_remote_prefill": True, "remote_block_ids": "0,1", "remote_engine_id": "e", "remote_request_id": "r",
      "remote_host": "h", "remote_port": 1}, "remote_block_ids"),
    ({"do_remote_prefill": True, "remote_block_ids": [0], "remote_engine_id": "e", "remote_request_id": "r",
      "remote_host": "h", "remote_port": 70000}, "remote_port"),
    ("yes", "kv_transfer_params"),
])
def test_malformed_params_are_the_requests_error(pair, params, field):
    with pytest.raises(EngineError, match=field) as refused:
        pair[1].add_request(EngineRequest("bad", prompt(5), GREEDY, kv_transfer_params=params))
    assert refused.value.kind == "invalid"


def remote(port: int, request_id: str = "s") -> dict:
    return {"do_remote_prefill": True, "remote_engine_id": "e", "remote_request_id": request_id,
            "remote_block_ids": list(range(10)), "remote_host": "127.0.0.1", "remote_port": port}


def test_a_read_in_flight_never_stalls_the_batch_and_a_producer_that_dies_means_a_recompute(make_engine, pair):
    _, _, solo = pair
    consumer = make_engine("consumer")
    ids = prompt(6)
    expected, _ = run(solo, EngineRequest("s", ids, GREEDY))
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts, never answers
        port = silent.getsockname()[1]
        consumer.add_request(EngineRequest("s", ids, GREEDY, kv_transfer_params=remote(port)))
        consumer.add_request(EngineRequest("busy", prompt(7, 20), GREEDY))
        busy, _ = finish_one(consumer, "busy")
        assert len(busy) == GREEDY.max_tokens  # ran to its end while the read hung
        assert list(consumer.scheduler.loading) == ["s"]
    # The listener closed with the read pending: the connection is reset, the prompt recomputed.
    tokens, last = finish(consumer, "s")
    assert tokens == expected and last.timings["kv_transfer_failed"] == 1
    assert run(consumer, EngineRequest("s2", prompt(12), GREEDY, kv_transfer_params=remote(port, "s2")))[1] \
        .timings["kv_transfer_failed"] == 1  # nobody listens there now: refused at once
    assert consumer.stats().kv_transfer_failures == 2
    assert all_blocks_back(consumer)


def finish_one(engine, request_id: str):
    """Step `engine` until `request_id` ends (others may still run): its tokens and last output."""
    tokens = []
    while True:
        for out in engine.step():
            if out.request_id == request_id:
                tokens += out.new_token_ids
                if out.finished:
                    return tokens, out


def test_a_read_without_progress_times_out_into_a_recompute(make_engine, pair):
    _, _, solo = pair
    consumer = make_engine("consumer", kv_transfer_timeout_s=0.2)
    ids = prompt(13)
    with socket.create_server(("127.0.0.1", 0)) as silent:
        tokens, last = run(consumer, EngineRequest("t", ids, GREEDY, kv_transfer_params=remote(silent.getsockname()[1], "t")))
    assert tokens == run(solo, EngineRequest("t", ids, GREEDY))[0]
    assert last.timings["kv_transfer_failed"] == 1 and last.timings["kv_transfer_ended"] - last.timings["kv_transfer_started"] < 5


def test_the_consumers_prefix_cache_is_used_and_only_the_rest_is_read(pair):
    producer, consumer, solo = pair
    shared = prompt(8, 24)
    ids = shared + prompt(9, 17)
    run(consumer, EngineRequest("warm", shared + [1], GREEDY))  # the consumer caches the shared blocks
    expected, _ = run(solo, EngineRequest("p", ids, GREEDY))
    tokens, last = run(consumer, EngineRequest("p", ids, GREEDY, kv_transfer_params=prefill(producer, "p", ids)))
    assert tokens == expected
    assert last.timings["cached_tokens"] == 24
    assert last.timings["kv_transfer_tokens"] == (len(ids) - 1) // BLOCK * BLOCK - 24  # past its own blocks
    assert last.timings["computed_prompt_tokens"] == 1  # 41 tokens: 24 its own, 16 read, the last computed
    assert last.timings["kv_transfer_bytes"] == 16 // BLOCK * consumer_block_bytes(consumer)
    # The blocks it read entered its prefix cache: the same prompt again reads nothing.
    again, last = run(consumer, EngineRequest("p2", ids, GREEDY, kv_transfer_params=prefill(producer, "p2", ids)))
    assert again == expected and "kv_transfer_started" not in last.timings
    producer.kv.held.evict_oldest()
    assert all_blocks_back(producer) and all_blocks_back(consumer)


def consumer_block_bytes(engine) -> int:
    cache = engine.executor.kv_cache
    return sum(t[0].numel() * t.element_size() for layer in cache.layers for t in (layer.key, layer.value))


def test_unread_blocks_are_freed_after_the_hold_timeout_and_the_consumer_recomputes(make_engine, pair):
    _, consumer, solo = pair
    producer = make_engine("producer", kv_hold_timeout_s=0.05)
    ids = prompt(10)
    params = prefill(producer, "h", ids)
    assert producer.stats().kv_blocks_held == len(params["remote_block_ids"])
    assert not producer.has_unfinished()  # an idle producer's loop waits ...
    time.sleep(0.1)
    assert producer.has_unfinished()  # ... until a hold is past its deadline: one step frees it
    producer.step()
    assert all_free(producer) and producer.stats().kv_holds_expired == 1 and not producer.has_unfinished()
    tokens, last = run(consumer, EngineRequest("h", ids, GREEDY, kv_transfer_params=params))
    assert tokens == run(solo, EngineRequest("h", ids, GREEDY))[0] and last.timings["kv_transfer_failed"] == 1


def all_free(engine) -> bool:
    """Every block free now, without a step (all_blocks_back steps the scheduler, which frees holds)."""
    bm = engine.scheduler.block_manager
    return bm.num_free_blocks == bm.num_blocks


def test_released_blocks_are_freed_at_once_and_the_consumer_recomputes(pair):
    """The gateway's release (no decode engine will read them) frees a hold long before its
    timeout; another engine's id or an unknown request releases nothing."""
    producer, consumer, solo = pair
    ids = prompt(15)
    params = prefill(producer, "rel", ids)
    released = producer.stats().kv_holds_released
    producer.release_kv("0" * 32, "rel")  # another engine's id (params from before a restart)
    producer.release_kv(params["remote_engine_id"], "nobody")
    assert producer.stats().kv_blocks_held == len(params["remote_block_ids"]) and not all_free(producer)
    producer.release_kv(params["remote_engine_id"], "rel")
    assert all_free(producer) and producer.stats().kv_blocks_held == 0
    assert producer.stats().kv_holds_released == released + 1
    producer.release_kv(params["remote_engine_id"], "rel")  # twice: nothing more
    assert producer.stats().kv_holds_released == released + 1
    tokens, last = run(consumer, EngineRequest("rel", ids, GREEDY, kv_transfer_params=params))
    assert tokens == run(solo, EngineRequest("rel", ids, GREEDY))[0] and last.timings["kv_transfer_failed"] == 1
    assert all_blocks_back(consumer)


def test_an_abort_after_the_prefill_finished_frees_its_held_blocks(pair):
    """The client left as its prefill hop ended: the abort finds the request held, not running."""
    producer, _, _ = pair
    released = producer.stats().kv_holds_released
    prefill(producer, "ab", prompt(16))
    producer.abort("ab")
    assert all_free(producer) and producer.stats().kv_holds_released == released + 1


def test_a_release_leaves_a_hold_being_read_to_its_read():
    held = HeldBlocks("e")
    seq = Sequence("r", [1] * 8)
    seq.block_table = [1, 2]
    held.hold(seq, [b"a", b"b"], 60)
    hold, _ = held.claim("e", "r", [1, 2], [b"a", b"b"], 0)
    assert not held.drop("e", "r") and held.take_freeable(time.monotonic()) == []
    held.release(hold, served=True)
    assert held.take_freeable(time.monotonic()) == [seq]
    assert (held.stats.served, held.stats.released) == (1, 0)


def test_a_request_aborted_while_its_blocks_are_read_keeps_them_until_the_read_ends(pair):
    """The loader writes the blocks as they arrive, beside the steps: the aborted request's
    blocks must not go to another request before the read has stopped writing them."""
    producer, consumer, _ = pair
    ids = prompt(11)
    params = prefill(producer, "a", ids)
    loads_before = consumer.stats().kv_transfers
    gate = threading.Event()
    loader = consumer.kv.port.loader
    fetch = loader._fetch
    loader._fetch = lambda load: (gate.wait(5), fetch(load))[1]  # hold the read until the abort is in
    try:
        consumer.add_request(EngineRequest("a", ids, GREEDY, kv_transfer_params=params))
        consumer.step()
        assert "a" in consumer.scheduler.loading
        consumer.abort("a")
        assert not all_blocks_back(consumer, wait_s=0.2)  # still the read's to write
        assert consumer.has_unfinished()  # the engine loop steps on until the read ends
        gate.set()
        finish(consumer, "a")  # takes the finished read and gives its blocks back
    finally:
        loader._fetch = fetch
    assert producer.stats().kv_transfers_served >= 1  # the read itself went through ...
    assert consumer.stats().kv_transfers == loads_before  # ... and was dropped, not counted
    assert all_blocks_back(consumer) and not consumer.has_unfinished()


def prefill_then_wait(checkpoint: str, ids: list[int], conn) -> None:
    """A producer engine process: one prefill for a remote decode, its params sent back, then it
    holds the blocks until it is killed."""
    conn.send(prefill(build_engine(checkpoint, "producer"), "k", ids))
    time.sleep(600)


def test_a_prefill_engine_killed_before_the_read_means_a_recompute_on_the_decode_side(checkpoint, pair):
    _, consumer, solo = pair
    ids = prompt(14)
    expected, _ = run(solo, EngineRequest("k", ids, GREEDY))
    spawn = multiprocessing.get_context("spawn")
    ours, theirs = spawn.Pipe()
    producer = spawn.Process(target=prefill_then_wait, args=(checkpoint, ids, theirs), daemon=True)
    producer.start()
    try:
        assert ours.poll(300), "the producer process did not answer"
        params = ours.recv()
    finally:
        os.kill(producer.pid, signal.SIGKILL)
        producer.join(30)
    tokens, last = run(consumer, EngineRequest("k", ids, GREEDY, kv_transfer_params=params))
    assert tokens == expected and last.timings["kv_transfer_failed"] == 1
    assert all_blocks_back(consumer)


def test_a_request_prefilled_again_while_its_blocks_are_read_keeps_the_new_hold():
    held = HeldBlocks("e")
    first, second = Sequence("r", [1] * 8), Sequence("r", [2] * 8)
    first.block_table, second.block_table = [1, 2], [3, 4]
    held.hold(first, [b"a", b"b"], 60)
    hold, refusal = held.claim("e", "r", [1, 2], [b"a", b"b"], 0)
    assert refusal is None and held.claim("e", "r", [1, 2], [b"a", b"b"], 0)[1] == \
        "the blocks of this request are being read"
    held.hold(second, [b"c", b"d"], 60)  # a retried prefill of the same id, while the first is read
    held.release(hold, served=True)
    assert held.take_freeable(time.monotonic()) == [first]  # the first freed once read, the second held
    assert held.claim("e", "r", [2], [b"b"], 1)[1] == "block ids that are not this request's"
    assert held.claim("e", "r", [4], [b"d"], 2)[1] == "block positions outside the request's full blocks"
    assert held.claim("e", "r", [4], [b"d"], 1)[1] is None


def kv_read_threads() -> int:
    return sum(thread.name == "kvgate-kv-read" for thread in threading.enumerate())


def wait_until(condition, wait_s: float = 10.0) -> bool:
    deadline = time.monotonic() + wait_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def test_connections_over_the_cap_are_refused_at_once_and_the_consumer_recomputes(make_engine, pair):
    """A flood of connections to a producer's block server: at most kv_transfer_max_connections
    are served (a thread each), the others are answered with a refusal at once (counted), and a
    consumer refused so recomputes; once the slots free, reads go through again."""
    _, _, solo = pair
    producer = make_engine("producer", kv_transfer_max_connections=2)
    consumer = make_engine("consumer", enable_prefix_caching=False)
    server = producer.kv.port.server
    ids = prompt(17)
    expected, _ = run(solo, EngineRequest("c", ids, GREEDY))
    params = prefill(producer, "c", ids)
    threads_before, refused = kv_read_threads(), producer.stats().kv_transfers_refused
    flood = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(12)]  # send nothing
    try:
        for sock in flood[2:]:  # the two first hold the slots, the others are told why at once
            sock.settimeout(10)
            assert "kv_transfer_max_connections" in recv_header(sock)["error"]
        assert kv_read_threads() - threads_before <= 2
        assert producer.stats().kv_transfers_refused == refused + 10
        tokens, last = run(consumer, EngineRequest("c", ids, GREEDY, kv_transfer_params=params))
        assert tokens == expected and last.timings["kv_transfer_failed"] == 1
        assert producer.stats().kv_transfers_refused == refused + 11
    finally:
        for sock in flood:
            sock.close()
    assert wait_until(lambda: kv_read_threads() == threads_before)  # the slots are free again
    tokens, last = run(consumer, EngineRequest("c2", ids, GREEDY, kv_transfer_params=params))
    assert tokens == expected and "kv_transfer_failed" not in last.timings  # the hold outlived the refusal
    assert all_blocks_back(producer) and all_blocks_back(consumer)


def test_idle_connections_are_closed_before_their_header_and_real_reads_go_through(pair):
    """Issue 40 item 11: as many idle sockets as the server has slots (64, the default) are closed
    for want of a read request within the header deadline (~1 s), not held for the 30 s read
    timeout, so a real read right after them is served rather than refused over the cap."""
    producer, consumer, solo = pair
    server = producer.kv.port.server
    ids = prompt(18)
    expected, _ = run(solo, EngineRequest("i", ids, GREEDY))
    params = prefill(producer, "i", ids)
    idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(server.max_connections)]
    try:
        for sock in idle:
            sock.settimeout(10)  # far below the 30 s read timeout, far above the header deadline
            assert sock.recv(1) == b"", "the server kept an idle connection open"
        assert wait_until(lambda: server._slots._value == server.max_connections)
        tokens, last = run(consumer, EngineRequest("i", ids, GREEDY, kv_transfer_params=params))
        assert tokens == expected and "kv_transfer_failed" not in last.timings
    finally:
        for sock in idle:
            sock.close()
    assert all_blocks_back(producer) and all_blocks_back(consumer)


@pytest.mark.parametrize("dtype,head_dim", [("float32", 4), ("fp8_e4m3", 3), ("int8", 3)])
def test_blocks_written_from_a_payload_equal_the_blocks_read(dtype, head_dim):
    """Rows of whole machine words move as words, odd rows (fp8 or int8 with 3-wide heads: 3-byte
    rows) as bytes: both give back exactly the bytes read, in the blocks named, and nothing else."""
    from native_backend.execution.kv_transfer.blocks import read_blocks, write_blocks
    from native_backend.model.kv_cache import KVCache

    def cache() -> KVCache:
        return KVCache(num_layers=2, num_blocks=6, block_size=1, num_kv_heads=1, head_dim=head_dim, dtype=dtype)

    source, target = cache(), cache()
    for layer in source.layers:
        for tensor in (layer.key, layer.value, layer.key_scales, layer.value_scales):
            if tensor is not None:
                tensor.view(torch.uint8).copy_(torch.randint(0, 256, tensor.view(torch.uint8).shape))
    payload = bytearray(b"".join(bytes(part) for part in read_blocks(source, [4, 1])))
    write_blocks(target, [0, 5], payload)
    for ours, theirs in zip(target.layers, source.layers):
        for name in ("key", "value", "key_scales", "value_scales"):
            got, sent = getattr(ours, name), getattr(theirs, name)
            if sent is not None:
                assert torch.equal(got[[0, 5]].view(torch.uint8), sent[[4, 1]].view(torch.uint8))
                assert not got[[1, 2, 3, 4]].view(torch.uint8).any()


# --- who a consumer reads from, and what it accepts (issue 40 item 2) -------------------------

def fake_producer(answer) -> tuple[socket.socket, threading.Thread, list]:
    """A listener on loopback that reads one read request and answers with `answer(header)`'s
    bytes; the headers it was sent are kept."""
    server = socket.create_server(("127.0.0.1", 0))
    seen = []

    def serve():
        with contextlib.suppress(OSError):
            conn, _ = server.accept()
            with conn:
                header = recv_header(conn)
                seen.append(header)
                conn.sendall(answer(header))
                conn.recv(1)  # until the consumer closes

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return server, thread, seen


def framed(header: dict) -> bytes:
    body = json.dumps(header).encode()
    return len(body).to_bytes(4, "big") + body


def test_a_forged_payload_of_the_right_size_is_recomputed_and_never_cached(make_engine, pair):
    """The attack of the issue: a host named in the params answers 'ok' with zeros of the right
    size. Without the engines' key it cannot make the payload's MAC: the consumer recomputes (the
    solo engine's tokens), and the same prompt later hits blocks it computed itself."""
    _, _, solo = pair
    consumer = make_engine("consumer")
    block_bytes = consumer_block_bytes(consumer)
    ids = prompt(19)
    expected, _ = run(solo, EngineRequest("x", ids, GREEDY))

    def garbage(header):
        n = len(header["block_ids"]) * block_bytes
        return framed({"ok": True, "nbytes": n}) + bytes(n) + framed({"mac": "00" * 32})

    server, thread, seen = fake_producer(garbage)
    with server:
        params = remote(server.getsockname()[1], "x")
        tokens, last = run(consumer, EngineRequest("x", ids, GREEDY, kv_transfer_params=params))
    thread.join(10)
    assert seen, "the consumer never asked the forged producer"
    assert tokens == expected and last.timings["kv_transfer_failed"] == 1
    again, last = run(consumer, EngineRequest("x2", ids, GREEDY))
    assert again == expected and last.timings["cached_tokens"] > 0  # its own blocks, not the zeros
    assert all_blocks_back(consumer)


def test_a_producer_with_another_key_is_recomputed(make_engine, pair, monkeypatch):
    """A real producer's real blocks, but keyed by another secret than the consumer's: the MAC
    differs, so the read fails and the prompt is recomputed (the bytes did go out)."""
    producer, _, solo = pair
    monkeypatch.setenv("KVGATE_TEST_OTHER_KEY", "another-secret")
    consumer = make_engine("consumer", kv_transfer_key_env="KVGATE_TEST_OTHER_KEY")
    ids = prompt(20)
    expected, _ = run(solo, EngineRequest("k2", ids, GREEDY))
    served = producer.stats().kv_transfers_served
    tokens, last = run(consumer, EngineRequest("k2", ids, GREEDY, kv_transfer_params=prefill(producer, "k2", ids)))
    assert tokens == expected and last.timings["kv_transfer_failed"] == 1
    assert wait_until(lambda: producer.stats().kv_transfers_served == served + 1)
    assert all_blocks_back(producer) and all_blocks_back(consumer)


def test_a_producer_off_the_allow_list_is_never_connected_to(make_engine, pair):
    """A consumer allowed only another network recomputes at once: no connection reaches the
    named producer (no SSRF); the same consumer allowed it by name ('localhost') reads it."""
    producer, _, solo = pair
    fenced = make_engine("consumer", kv_allowed_producers=["10.255.0.0/16"], enable_prefix_caching=False)
    named = make_engine("consumer", kv_allowed_producers=["localhost"])
    ids = prompt(21)
    expected, _ = run(solo, EngineRequest("w", ids, GREEDY))
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.setblocking(False)
        for host in ("127.0.0.1", "::ffff:127.0.0.1", "localhost"):
            params = {**remote(listener.getsockname()[1], "w"), "remote_host": host}
            tokens, last = run(fenced, EngineRequest(f"w-{host}", ids, GREEDY, kv_transfer_params=params))
            assert tokens == expected and last.timings["kv_transfer_failed"] == 1, host
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody connected
    tokens, last = run(named, EngineRequest("w2", ids, GREEDY, kv_transfer_params=prefill(producer, "w2", ids)))
    assert tokens == expected and "kv_transfer_failed" not in last.timings
    assert all_blocks_back(fenced) and all_blocks_back(named) and all_blocks_back(producer)


def test_a_producer_that_never_answers_is_given_up_on_after_the_header_timeout(make_engine, pair):
    """A host that accepts and never answers held a load thread for kv_transfer_timeout_s (30 s);
    the read request's answer has kv_transfer_header_timeout_s (2 s) instead."""
    _, _, solo = pair
    consumer = make_engine("consumer")  # kv_transfer_timeout_s 30, header timeout 2
    ids = prompt(22)
    with socket.create_server(("127.0.0.1", 0)) as silent:
        params = remote(silent.getsockname()[1], "n")
        tokens, last = run(consumer, EngineRequest("n", ids, GREEDY, kv_transfer_params=params))
    assert tokens == run(solo, EngineRequest("n", ids, GREEDY))[0] and last.timings["kv_transfer_failed"] == 1
    assert last.timings["kv_transfer_ended"] - last.timings["kv_transfer_started"] < 15  # not the 30 s read timeout


@pytest.mark.parametrize("entries, host, admitted", [
    (["127.0.0.0/8", "::1"], "127.0.0.1", True),
    (["127.0.0.0/8", "::1"], "::ffff:127.0.0.1", True),  # the IPv4 address it carries
    (["10.0.0.0/8"], "::ffff:127.0.0.1", False),
    (["10.0.0.0/8"], "::ffff:169.254.169.254", False),
    (["10.0.0.0/8"], "169.254.169.254", False),
    (["10.1.2.3"], "10.1.2.3", True),
    (["10.1.2.3"], "10.1.2.4", False),
    (["*"], "192.0.2.7", True),
    (["localhost"], "127.0.0.1", True),
    ([], "127.0.0.1", False),
])
def test_the_allow_list_admits_what_it_lists(entries, host, admitted):
    allowed = ProducerAllowList(entries)
    if admitted:
        assert ipaddress.ip_address(allowed.address(host, 5600)) == ipaddress.ip_address(host.removeprefix("::ffff:"))
    else:
        with pytest.raises(PermissionError, match="kv_allowed_producers"):
            allowed.address(host, 5600)


# --- cache_salt (issue 40 item 4) ----------------------------------------------------------------

def test_a_salted_prompt_hits_only_its_own_salts_blocks(pair):
    """Tenant B cannot learn from a cache hit whether tenant A sent a prompt: under another salt
    (or none) the same prompt finds nothing cached; under its own salt it hits."""
    _, _, solo = pair
    ids = prompt(23)
    expected, first = run(solo, EngineRequest("s-a", ids, GREEDY, cache_salt="tenant-a"))
    assert first.timings["cached_tokens"] == 0
    for name, salt, hit in (("s-b", "tenant-b", False), ("s-none", None, False), ("s-a2", "tenant-a", True)):
        tokens, last = run(solo, EngineRequest(name, ids, GREEDY, cache_salt=salt))
        assert tokens == expected and (last.timings["cached_tokens"] > 0) == hit, name


def test_a_read_is_served_only_under_the_salt_of_its_prefill(pair):
    """The producer's held blocks are hashed under the prefill's salt: a decode request with that
    salt reads them, one with another salt asks for other hashes and recomputes."""
    producer, consumer, solo = pair
    ids = prompt(24)
    expected, _ = run(solo, EngineRequest("t", ids, GREEDY))

    def prefill_salted(request_id):
        request = EngineRequest(request_id, ids, PREFILL, kv_transfer_params={"do_remote_decode": True},
                                cache_salt="tenant-a")
        return run(producer, request)[1].kv_transfer_params

    tokens, last = run(consumer, EngineRequest("t-b", ids, GREEDY, cache_salt="tenant-b",
                                               kv_transfer_params=prefill_salted("t-b")))
    assert tokens == expected and last.timings["kv_transfer_failed"] == 1
    tokens, last = run(consumer, EngineRequest("t-a", ids, GREEDY, cache_salt="tenant-a",
                                               kv_transfer_params=prefill_salted("t-a")))
    assert tokens == expected and "kv_transfer_failed" not in last.timings and last.timings["kv_transfer_tokens"] > 0
    producer.kv.held.evict_oldest()
    assert all_blocks_back(producer) and all_blocks_back(consumer)
