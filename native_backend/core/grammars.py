"""Grammar compilation off the step loop: two worker threads, a bounded cache, a deadline per compile.

    add_request ──submit(spec)──> cache hit: a done future          (hits += 1)
                                  same spec compiling: its future  (shared, no second compile)
                                  else: a worker compiles it        (compiles += 1)
    step() ──expired()/future.done()──> requests whose grammar is done, failed, or past the deadline
    abort ──release(spec)──> the last waiter gone: a compile not started yet is cancelled

A request waits here, outside the scheduler, until its grammar is compiled: the batch runs on
meanwhile. A compile is the library's compile plus the first token's mask and one step past it
(`Grammar.warm`): llguidance builds its lexer lazily, and a hostile regex's lexer cost seconds on
the step loop at the first mask. A compile still running `compile_timeout_s` after it started
(not after it was queued) fails its requests (a 400 naming the parameter); the worker finishes it
anyway, bounded by llguidance's fuel limits (text.grammar.PARSER_LIMITS). Two workers, so one
such compile does not hold every other request's. The cache keeps the most recently used grammars
within `cache_size` grammars and `cache_bytes` bytes (each charged the growth of the process's
resident memory across its compile and warm-up: an over-estimate when both workers compile at
once). The first task builds the compiler itself (the tokenizer's token trie, ~1 s), so an
engine's start does not wait for it and the first constrained request does.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from native_backend.config.engine import GrammarOptions
from native_backend.text.grammar import Grammar, GrammarCompiler
from native_backend.text.grammar_spec import GrammarSpec, short

log = logging.getLogger("kvgate.engine.grammar")
WORKERS = 2
MIN_CHARGE_BYTES = 64 << 10  # a grammar's least charge (resident memory moves in pages, and may not move)


@dataclass
class GrammarStats:
    compiles: int = 0  # grammars compiled (cache misses)
    cache_hits: int = 0  # requests served a grammar compiled before (or compiling for another)
    failures: int = 0  # specs the library refused or that ran past the deadline
    compile_seconds: float = 0.0  # time spent compiling, all compiles together
    evictions: int = 0  # grammars dropped because a request's matcher errored on them
    cancelled: int = 0  # compiles never started: every request waiting for them was aborted


def _resident_bytes() -> int:
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * 4096
    except (OSError, ValueError, IndexError):
        return 0


class GrammarService:
    def __init__(self, make_compiler: Callable[[], GrammarCompiler], options: GrammarOptions = GrammarOptions()):
        """`options`: the size limit, compile deadline and cache bounds (EngineConfig.grammar; a
        gateway sets them from its server.limits)."""
        self.compile_timeout_s = options.compile_timeout_s
        self.max_bytes = options.max_bytes
        self.stats = GrammarStats()
        self._cache_size = options.cache_size
        self._cache_bytes = options.cache_bytes
        self._done: OrderedDict[tuple, Grammar] = OrderedDict()  # LRU of compiled grammars
        self.cached_bytes = 0
        self._compiling: dict[tuple, concurrent.futures.Future] = {}
        self._waiters: dict[tuple, int] = {}  # requests waiting for each compiling spec
        self._started: dict[tuple, float] = {}  # when a worker began each compiling spec (monotonic)
        self._lock = threading.Lock()  # the workers finish futures, the step loop reads
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="kvgate-grammar")
        self._compiler = self._pool.submit(make_compiler)

    def submit(self, spec: GrammarSpec) -> concurrent.futures.Future:
        """A future of the compiled grammar. Raises GrammarError at once for a spec that is
        malformed or over the size limit. Each submit is one waiter until `release(spec)`."""
        spec.check(self.max_bytes)
        key = spec.key
        with self._lock:
            grammar = self._done.get(key)
            if grammar is not None:
                self._done.move_to_end(key)
                self.stats.cache_hits += 1
                return _done_future(grammar)
            future = self._compiling.get(key)
            if future is not None:
                self.stats.cache_hits += 1
            else:
                future = self._compiling[key] = self._pool.submit(self._compile, spec)
            self._waiters[key] = self._waiters.get(key, 0) + 1
            return future

    def expired(self, spec: GrammarSpec, now: float) -> bool:
        """Whether the spec's compile has run past the deadline, counted from when a worker began
        it (a compile still queued behind others has not started its clock)."""
        with self._lock:
            started = self._started.get(spec.key)
        return started is not None and now > started + self.compile_timeout_s

    def release(self, spec: GrammarSpec) -> None:
        """A request stopped waiting for the spec (it was admitted, refused or aborted); when none
        waits any more, a compile not yet started is cancelled."""
        key = spec.key
        with self._lock:
            if key not in self._waiters:
                return
            self._waiters[key] -= 1
            if self._waiters[key] > 0:
                return
            del self._waiters[key]
            future = self._compiling.get(key)
            if future is not None and future.cancel():
                del self._compiling[key]
                self.stats.cancelled += 1

    def evict(self, spec: GrammarSpec) -> None:
        """Drop a grammar a request's matcher errored on: the next request compiles it afresh
        (and a spec that fails again is refused at its compile)."""
        with self._lock:
            grammar = self._done.pop(spec.key, None)
            if grammar is not None:
                self.cached_bytes -= grammar.nbytes
                self.stats.evictions += 1

    def _compile(self, spec: GrammarSpec) -> Grammar:
        started = time.perf_counter()
        with self._lock:
            self._started[spec.key] = time.monotonic()
        resident = _resident_bytes()
        try:
            grammar = self._compiler.result().compile(spec)
            grammar.warm()
        except BaseException as exc:
            log.info("compiling %s failed: %s", spec.param, short(str(exc)))
            with self._lock:
                self.stats.failures += 1
                self._forget(spec.key)
            raise
        grammar.nbytes = max(MIN_CHARGE_BYTES, _resident_bytes() - resident)
        with self._lock:
            self.stats.compiles += 1
            self.stats.compile_seconds += time.perf_counter() - started
            self._forget(spec.key)
            self._keep(spec.key, grammar)
        return grammar

    def _forget(self, key: tuple) -> None:
        self._compiling.pop(key, None)
        self._started.pop(key, None)

    def _keep(self, key: tuple, grammar: Grammar) -> None:
        """Cache the grammar, then drop the least recently used past either bound (a grammar
        larger than the whole byte budget is not kept at all)."""
        self._done[key] = grammar
        self.cached_bytes += grammar.nbytes
        while self._done and (len(self._done) > self._cache_size or self.cached_bytes > self._cache_bytes):
            _, dropped = self._done.popitem(last=False)
            self.cached_bytes -= dropped.nbytes

    def note_timeout(self) -> None:
        with self._lock:
            self.stats.failures += 1

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _done_future(value) -> concurrent.futures.Future:
    future = concurrent.futures.Future()
    future.set_result(value)
    return future
