"""The KV connector's scheduler side: prefill/decode disaggregation in the engine core (no torch).

In the spirit of vLLM's KVConnectorBase_V1, split the same way: this module decides, the
execution side's connector (execution/kv_transfer) moves bytes. The protocol is vLLM's NIXL
connector's `kv_transfer_params`, so a gateway that drives vLLM engines drives ours unchanged:

    producer (prefill engine)                         consumer (decode engine)
    request {do_remote_decode: true}, max_tokens 1    request {do_remote_prefill: true, remote_*}
      computes the prompt, samples one token            admitted: blocks allocated for the prompt's
      finishes on length -> `hold_for_remote`:            full blocks past its own prefix cache;
      its blocks stay referenced (HeldBlocks),            WAITING_FOR_REMOTE_KV (never scheduled,
      the answer carries                                  the batch runs on) while the worker reads
      {do_remote_prefill: true, remote_engine_id,         them from remote_host:remote_port
       remote_block_ids, remote_request_id,  ────────>  loaded: the blocks count as computed (and
       remote_host, remote_port, tp_size,                 enter its prefix cache); the rest of the
       remote_num_tokens}                                 prompt (at least its last token) runs here
      HeldBlocks frees them once served, after          failed (refused, timed out, producer gone):
      kv_hold_timeout_s, or when the gateway says         the blocks are freed and the prompt is
      no consumer will read them (`drop`)                 recomputed, counted; never a wrong answer

Only whole blocks move, each checked against the chained hash of the consumer's own tokens
(`BlockManager.block_hashes`): the producer serves a block only if it holds it for that
request and its hash is the one asked for, so stale or forged params (unknown block ids, another
request's, another engine's) end in a recompute, never in foreign KV.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Protocol

from native_backend.core.kv_params import Endpoint, KVLoad, RemotePrefill, parse_transfer_params
from native_backend.core.sequence import Sequence


class LoadResult(Protocol):
    load: KVLoad
    ok: bool
    error: str | None
    nbytes: int
    seconds: float


class KVTransferPort(Protocol):
    """The connector's worker side as the core drives it (execution.kv_transfer.KVConnectorWorker)."""

    endpoint: Endpoint | None  # None: this engine does not produce
    held: HeldBlocks
    tp_size: int  # ranks this engine's blocks are split over (its tensor_parallel_size): the answer's tp_size

    def start_loads(self, loads: list[KVLoad]) -> None:
        """Start reading each load's blocks off the step loop."""

    def take_finished(self) -> list[LoadResult]:
        """Loads that ended since the last call (read into a staging buffer, or failed)."""

    def commit(self, result: LoadResult) -> None:
        """Copy a successful load's staged blocks into the cache (the step loop's thread)."""

    def wait(self, timeout: float) -> None:
        """Block until a load ends or `timeout` seconds pass."""


@dataclass
class _Hold:
    seq: Sequence  # finished; its block_table still referenced
    hashes: list[bytes]  # the chained hashes of its full blocks
    deadline: float  # time.monotonic()
    claimed: bool = False  # being served now: not freed under the reader's feet


@dataclass
class HoldStats:
    served: int = 0  # reads served
    refused: int = 0  # reads refused: unknown request, block ids or hashes (stale or forged params), over the cap
    expired: int = 0  # holds freed unread after kv_hold_timeout_s, or for room
    released: int = 0  # holds freed unread because the gateway said no consumer will read them (`drop`)


class HeldBlocks:
    """A producer's finished prefills whose blocks wait for a consumer. The step loop holds and
    frees (it owns the block manager); the transfer server's threads claim and serve."""

    def __init__(self, engine_id: str):
        self.engine_id = engine_id
        self._lock = threading.Lock()
        self._holds: dict[str, _Hold] = {}
        self._done: list[Sequence] = []  # served or replaced: the step loop frees their blocks
        self.stats = HoldStats()

    def hold(self, seq: Sequence, hashes: list[bytes], timeout_s: float) -> None:
        with self._lock:
            old = self._holds.pop(seq.request_id, None)
            if old is not None and not old.claimed:  # a claimed one is freed by its read's release
                self._done.append(old.seq)
            self._holds[seq.request_id] = _Hold(seq, hashes, time.monotonic() + timeout_s)

    def claim(self, engine_id: str, request_id: str, block_ids: list[int], hashes: list[bytes],
              first_block: int) -> tuple[_Hold | None, str | None]:
        """Reserve a hold for one read of `block_ids` (positions first_block.. of its table):
        (the hold, None) when granted, else (None, why not)."""
        with self._lock:
            hold = self._holds.get(request_id)
            refusal = _refusal(self.engine_id, engine_id, hold, block_ids, hashes, first_block)
            if refusal is not None:
                self.stats.refused += 1
                return None, refusal
            hold.claimed = True
            return hold, None

    def release(self, hold: _Hold, served: bool) -> None:
        """A claimed read ended: its blocks go back to the step loop (a consumer reads once)."""
        with self._lock:
            if self._holds.get(hold.seq.request_id) is hold:  # not replaced by a newer prefill of that id
                del self._holds[hold.seq.request_id]
            self._done.append(hold.seq)
            self.stats.served += served

    def take_freeable(self, now: float) -> list[Sequence]:
        """Sequences whose blocks the step loop frees now: served ones, and unread ones past
        their deadline."""
        with self._lock:
            expired = [rid for rid, h in self._holds.items() if not h.claimed and h.deadline <= now]
            for rid in expired:
                self._done.append(self._holds.pop(rid).seq)
            self.stats.expired += len(expired)
            done, self._done = self._done, []
            return done

    def anything_to_free(self, now: float) -> bool:
        """Whether take_freeable(now) would give blocks back (an idle producer's loop steps for
        it: a served or expired hold must not wait for the next request to free its blocks)."""
        with self._lock:
            return bool(self._done) or any(not h.claimed and h.deadline <= now for h in self._holds.values())

    def evict_oldest(self) -> bool:
        """Give up the unread hold closest to its deadline (the cache needs room); False: none."""
        with self._lock:
            unclaimed = [(h.deadline, rid) for rid, h in self._holds.items() if not h.claimed]
            if not unclaimed:
                return False
            self._done.append(self._holds.pop(min(unclaimed)[1]).seq)
            self.stats.expired += 1
            return True

    def drop(self, engine_id: str, request_id: str) -> bool:
        """Give up the unread hold of `request_id` (the gateway knows no consumer will read it:
        its client left, or every decode attempt failed); the step loop frees its blocks as an
        expired one's. A claimed hold is left to its read, which frees it. False: nothing dropped
        (another engine's id, an unknown or already read request, a read in progress)."""
        with self._lock:
            hold = self._holds.get(request_id)
            if engine_id != self.engine_id or hold is None or hold.claimed:
                return False
            self._done.append(self._holds.pop(request_id).seq)
            self.stats.released += 1
            return True

    def note_refused(self) -> None:
        with self._lock:
            self.stats.refused += 1

    def num_blocks(self) -> int:
        with self._lock:
            return sum(len(h.seq.block_table) for h in self._holds.values())


def _refusal(own_engine: str, engine_id: str, hold: _Hold | None, block_ids: list[int], hashes: list[bytes],
             first_block: int) -> str | None:
    if engine_id != own_engine:
        return f"engine {engine_id!r} is not this engine"
    if hold is None:
        return "no blocks held for this request (unknown, already read, or expired)"
    if hold.claimed:
        return "the blocks of this request are being read"
    end = first_block + len(block_ids)
    if first_block < 0 or not block_ids or len(hashes) != len(block_ids) or end > len(hold.hashes):
        return "block positions outside the request's full blocks"
    if block_ids != hold.seq.block_table[first_block:end]:
        return "block ids that are not this request's"
    if hashes != hold.hashes[first_block:end]:
        return "block hashes that differ from the request's tokens"
    return None


# Upper bounds of the transfer histograms (Prometheus `le`; +Inf beyond the last).
BYTES_BUCKETS = (2**16, 2**18, 2**20, 2**22, 2**24, 2**26, 2**28, 2**30)
SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def _bucket(bounds: tuple, value: float) -> int:
    return next((i for i, bound in enumerate(bounds) if value <= bound), len(bounds))


@dataclass
class TransferCounters:
    """The consumer's side, since start."""

    loads: int = 0  # reads completed: their blocks counted as computed
    failed: int = 0  # reads refused, timed out or broken: the prompt was recomputed
    loaded_tokens: int = 0  # tokens whose KV the completed reads moved
    bytes: int = 0
    seconds: float = 0.0
    # Completed reads by size and by duration: counts per bucket (the last: beyond every bound).
    bytes_histogram: list[int] = field(default_factory=lambda: [0] * (len(BYTES_BUCKETS) + 1))
    seconds_histogram: list[int] = field(default_factory=lambda: [0] * (len(SECONDS_BUCKETS) + 1))

    def observe(self, nbytes: int, seconds: float) -> None:
        self.bytes_histogram[_bucket(BYTES_BUCKETS, nbytes)] += 1
        self.seconds_histogram[_bucket(SECONDS_BUCKETS, seconds)] += 1


class KVConnectorScheduler:
    """The scheduler's side of one engine's connector: its role, and what a producer answers."""

    def __init__(self, role: str, port: KVTransferPort, hold_timeout_s: float):
        self.produces = role in ("producer", "both")
        self.consumes = role in ("consumer", "both")
        self.port = port
        self.held = port.held
        self.hold_timeout_s = hold_timeout_s
        self.counters = TransferCounters()

    def mark(self, seq: Sequence, params) -> None:
        """What a request's kv_transfer_params ask of this engine, on the sequence; what its
        role does not do is ignored (the request is served as any other, as vLLM does)."""
        intent = parse_transfer_params(params)
        if isinstance(intent, RemotePrefill) and self.consumes and seq.pooling is None:
            seq.remote = intent
        elif intent is True and self.produces and seq.pooling is None:
            seq.for_remote_decode = True

    def hold_for_remote(self, seq: Sequence, reason: str, hashes: list[bytes]) -> bool:
        """A finished prefill for a remote decode keeps its blocks (vLLM's request_finished:
        only one that stopped on its token limit; aborts and stops answer nothing). True: held,
        `seq.kv_transfer_params` set."""
        if not (seq.for_remote_decode and reason == "length" and hashes and self.port.endpoint is not None):
            return False
        self.held.hold(seq, hashes, self.hold_timeout_s)
        where = self.port.endpoint
        seq.kv_transfer_params = {
            "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": where.engine_id,
            "remote_block_ids": list(seq.block_table), "remote_request_id": seq.request_id,
            "remote_host": where.host, "remote_port": where.port, "tp_size": self.port.tp_size,
            "remote_num_tokens": seq.num_computed_tokens}
        return True

    def stats(self) -> dict:
        """EngineStats' fields of prefill/decode disaggregation (both roles' counters)."""
        c, held = self.counters, self.held.stats
        return dict(kv_transfers=c.loads, kv_transfer_failures=c.failed, kv_transfer_tokens=c.loaded_tokens,
                    kv_transfer_bytes=c.bytes, kv_transfer_seconds=c.seconds,
                    kv_transfer_bytes_histogram=tuple(c.bytes_histogram),
                    kv_transfer_seconds_histogram=tuple(c.seconds_histogram),
                    kv_transfer_bytes_buckets=tuple(map(float, BYTES_BUCKETS)), kv_transfer_seconds_buckets=SECONDS_BUCKETS,
                    kv_blocks_held=self.held.num_blocks(), kv_transfers_served=held.served,
                    kv_transfers_refused=held.refused, kv_holds_expired=held.expired,
                    kv_holds_released=held.released)

    def finished(self, result: LoadResult) -> None:
        c = self.counters
        if result.ok:
            c.loads += 1
            c.loaded_tokens += result.load.moved_tokens
            c.bytes += result.nbytes
            c.seconds += result.seconds
            c.observe(result.nbytes, result.seconds)
        else:
            c.failed += 1
