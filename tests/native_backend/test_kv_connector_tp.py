"""Prefill/decode disaggregation under tensor parallelism: a producer engine and a consumer engine
at TP 2 (real worker processes, gloo, real TCP on loopback, the tiny GQA Llama whose two KV heads
TP 2 splits), against one single-rank engine serving the same request alone.

The consumer's greedy tokens are the solo engine's for fp32 KV and for int8 KV (its row scales
travel with each rank's shard), over a prompt the producer prefills in several chunks; every
rank's shard moves (the bytes are each rank's share); a rank whose shard fails breaks the whole
read, and the consumer recomputes (counted) with the same tokens; a consumer of another TP size
is refused by the producer, naming the sizes, and recomputes; a rank whose fp8 key offsets differ
makes the layouts differ (so the read is refused, as one rank's would be).
"""

from __future__ import annotations

import multiprocessing

import pytest
import torch

from native_backend.config.engine import EngineConfig
from native_backend.core.engine import LLMEngine
from native_backend.core.interface import EngineRequest
from native_backend.core.sampling_params import SamplingParams
from native_backend.execution import kv_scales
from native_backend.execution.factory import make_executor
from native_backend.execution.kv_transfer.blocks import block_bytes, layout_difference
from native_backend.execution.kv_transfer.connector import make_kv_transfer
from native_backend.execution.parallel.group import die_with_parent
from native_backend.execution.parallel.kv_relay import TensorParallelBlocks, worker_layout
from native_backend.model.kv_cache import KVCache
from native_backend.process.factory import kv_blocks
from tests.support.checks.kv_connector_checks import all_blocks_back, run
from tests.support.checks.tensor_parallel_checks import tiny_gqa_llama

pytestmark = pytest.mark.timeout(600)

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PREFILL = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
BLOCK, CHUNK = 4, 16  # a 37-token prompt: 3 prefill chunks on the producer, 9 whole blocks read


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.set_num_threads(1)
    return tiny_gqa_llama(tmp_path_factory.mktemp("tiny-gqa"))


def prompt(seed: int, length: int = 37) -> list[int]:
    return torch.randint(1, 96, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def build_engine(checkpoint: str, role, tp: int, kv_cache_dtype: str = "auto") -> LLMEngine:
    config = EngineConfig.build(path=checkpoint, num_threads=1, tensor_parallel_size=tp, kv_cache_bytes=1 << 20,
                                block_size=BLOCK, max_num_batched_tokens=CHUNK, kv_role=role,
                                kv_cache_dtype=kv_cache_dtype, kv_scales="unit")  # fp8: no tokenizer to calibrate
    executor = make_executor(config)
    return LLMEngine(config, executor, kv_transfer=make_kv_transfer(config.transfer, kv_blocks(executor)))


def serve_engine(checkpoint: str, role, tp: int, kv_cache_dtype: str, conn) -> None:
    """An engine process (one process holds one tensor-parallel group): runs what the test sends.

        ("run", request_id, ids, sampling, params) -> (tokens, timings, kv_transfer_params, finish_reason)
        ("stats",) -> EngineStats;  ("blocks_back",) -> every block free;  ("shard_bytes",) -> rank 0's
        ("break_next_shard",): rank 1's next shard read fails (after rank 0's shard was sent)
    """
    die_with_parent()  # not daemonic (it has a worker of its own): killed with the test's process instead
    engine = build_engine(checkpoint, role, tp, kv_cache_dtype)
    conn.send("ready")
    try:
        while (message := conn.recv())[0] != "stop":
            conn.send(_answer(engine, message))
    finally:
        if engine.kv.port.server is not None:
            engine.kv.port.server.close()
        engine.executor.close()


def _answer(engine, message):
    what = message[0]
    if what == "run":
        tokens, last = run(engine, EngineRequest(message[1], message[2], message[3], kv_transfer_params=message[4]))
        return tokens, last.timings, last.kv_transfer_params, last.finish_reason
    if what == "stats":
        return engine.stats()
    if what == "blocks_back":
        return all_blocks_back(engine)
    if what == "shard_bytes":
        return block_bytes(engine.executor.rank.kv_cache)
    if what == "break_next_shard":
        pipe = engine.kv.port.blocks.pipes[0]
        read = pipe.read

        def broken(block_ids):
            pipe.read = read
            raise ConnectionError("rank 1 did not give its KV shard")

        pipe.read = broken
        return None
    raise ValueError(what)


class EngineProcess:
    def __init__(self, checkpoint: str, role, tp: int, kv_cache_dtype: str = "auto"):
        spawn = multiprocessing.get_context("spawn")
        self.conn, theirs = spawn.Pipe()
        self.process = spawn.Process(target=serve_engine, args=(checkpoint, role, tp, kv_cache_dtype, theirs))
        self.process.start()

    def ready(self) -> EngineProcess:
        assert self.conn.poll(300) and self.conn.recv() == "ready", "the engine process did not start"
        return self

    def ask(self, *message):
        self.conn.send(message)
        assert self.conn.poll(300), f"no answer to {message[0]}"
        return self.conn.recv()

    def stop(self) -> None:
        try:
            self.conn.send(("stop",))
        except OSError:
            pass
        self.process.join(60)
        if self.process.is_alive():
            self.process.kill()


@pytest.fixture(scope="module")
def engines(checkpoint):
    """pair(kv_cache_dtype): a (producer, consumer) of engine processes at TP 2, started together (their
    starts overlap) on first use, stopped at the end of the module."""
    started: dict[str, tuple[EngineProcess, EngineProcess]] = {}

    def pair(kv_cache_dtype: str) -> tuple[EngineProcess, EngineProcess]:
        if kv_cache_dtype not in started:
            started[kv_cache_dtype] = tuple(EngineProcess(checkpoint, role, 2, kv_cache_dtype)
                                            for role in ("producer", "consumer"))
            for engine in started[kv_cache_dtype]:
                engine.ready()
        return started[kv_cache_dtype]

    try:
        yield pair
    finally:
        for engine in (e for two in started.values() for e in two):
            engine.stop()


@pytest.fixture(scope="module")
def solo(checkpoint):
    """One rank in this process, reading remote KV when asked: the reference, and a consumer of another TP size."""
    engines = {dtype: build_engine(checkpoint, "consumer", 1, dtype) for dtype in ("auto", "int8", "fp8_e4m3")}
    yield engines
    for engine in engines.values():
        engine.kv.port.close()


def prefill(producer: EngineProcess, request_id: str, ids: list[int]) -> dict:
    _, _, params, reason = producer.ask("run", request_id, ids, PREFILL, {"do_remote_decode": True})
    assert reason == "length"
    return params


def check_exact(producer: EngineProcess, consumer: EngineProcess, expected: list[int], ids: list[int],
                request_id: str) -> None:
    params = prefill(producer, request_id, ids)
    assert params["tp_size"] == 2 and params["remote_num_tokens"] == len(ids)
    before = consumer.ask("stats")
    tokens, timings, _, _ = consumer.ask("run", request_id, ids, GREEDY, params)
    assert tokens == expected
    moved_blocks = (len(ids) - 1) // BLOCK
    assert timings["kv_transfer_tokens"] == moved_blocks * BLOCK
    # Both ranks' shards moved: twice rank 0's bytes of each block (its process holds half the KV heads).
    assert timings["kv_transfer_bytes"] == moved_blocks * 2 * consumer.ask("shard_bytes")
    stats = consumer.ask("stats")
    assert stats.kv_transfers == before.kv_transfers + 1
    assert stats.kv_transfer_failures == before.kv_transfer_failures
    assert producer.ask("blocks_back") and consumer.ask("blocks_back")


# int8: each rank's row scales ride in its shard; fp8: each rank's layer scales in the layout (pairs of engines of
# their own: the slow tier)
SCALED = [pytest.param(dtype, marks=pytest.mark.slow) for dtype in ("int8", "fp8_e4m3")]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", *SCALED])
def test_tp2_consumer_decodes_from_a_tp2_producers_blocks_with_the_solo_engines_tokens(engines, solo, kv_cache_dtype):
    ids = prompt(1)
    expected, _ = run(solo[kv_cache_dtype], EngineRequest("e", ids, GREEDY))
    check_exact(*engines(kv_cache_dtype), expected, ids, "e")


def test_a_rank_whose_shard_fails_makes_the_consumer_recompute_the_whole_prompt(engines, solo):
    producer, consumer = engines("auto")
    ids = prompt(3)
    expected, _ = run(solo["auto"], EngineRequest("f", ids, GREEDY))
    params = prefill(producer, "f", ids)
    producer.ask("break_next_shard")
    failures = consumer.ask("stats").kv_transfer_failures
    tokens, timings, _, _ = consumer.ask("run", "f", ids, GREEDY, params)
    assert tokens == expected and timings["kv_transfer_failed"] == 1
    assert consumer.ask("stats").kv_transfer_failures == failures + 1
    assert producer.ask("blocks_back") and consumer.ask("blocks_back")
    # The rank's pipe is still in step: the next read moves both shards.
    ids = prompt(4)
    check_exact(producer, consumer, run(solo["auto"], EngineRequest("g", ids, GREEDY))[0], ids, "g")


def test_a_consumer_of_another_tp_size_is_refused_and_recomputes(engines, solo, caplog):
    producer, _ = engines("auto")
    ids = prompt(5)
    expected, _ = run(solo["auto"], EngineRequest("m", ids, GREEDY))
    params = prefill(producer, "m", ids)
    refused = producer.ask("stats").kv_transfers_refused
    solo["auto"].reset_prefix_cache()  # else its own cached blocks leave nothing to read
    with caplog.at_level("WARNING", logger="kvgate.engine"):
        tokens, last = run(solo["auto"], EngineRequest("m2", ids, GREEDY, kv_transfer_params=params))
    assert tokens == expected and last.timings["kv_transfer_failed"] == 1
    assert producer.ask("stats").kv_transfers_refused == refused + 1
    assert "tensor_parallel_size 1, this producer 2" in caplog.text
    assert all_blocks_back(solo["auto"])


def calibrated_fp8_shard(offset_seed: int) -> KVCache:
    """One rank's fp8 cache whose keys are stored minus per-layer offsets (a calibration's)."""
    cache = KVCache(num_layers=2, num_blocks=4, block_size=BLOCK, num_kv_heads=1, head_dim=8, dtype="fp8_e4m3")
    offsets = torch.randn(2, 1, 8, generator=torch.Generator().manual_seed(offset_seed))
    kv_scales.apply(cache, [(0.5, 0.25)] * 2, offsets)
    return cache


def tp2_layout(rank1_offset_seed: int) -> dict:
    return TensorParallelBlocks(calibrated_fp8_shard(0), [], [worker_layout(calibrated_fp8_shard(rank1_offset_seed))],
                                send_write=None).layout()


def test_a_tp_layout_carries_each_ranks_fp8_key_offsets():
    """Two TP 2 engines with the same scales whose rank 1 stores keys minus other offsets: their
    layouts differ (the producer refuses the read; test_kv_connector: the same at TP 1)."""
    ours, theirs = tp2_layout(1), tp2_layout(2)
    assert ours == tp2_layout(1) and ours["ranks"][0] == theirs["ranks"][0]
    assert ours["ranks"][1]["scales"] == theirs["ranks"][1]["scales"]
    assert ours["ranks"][1]["k_offsets"] != theirs["ranks"][1]["k_offsets"]
    assert "in ranks" in layout_difference(ours, theirs)
