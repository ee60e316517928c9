"""Grammar compilation off the step loop: a worker thread, a bounded cache, a deadline per request.

    add_request ──submit(spec)──> cache hit: a done future          (hits += 1)
                                  same spec compiling: its future  (shared, no second compile)
                                  else: the worker thread compiles (compiles += 1)
    step() ──ready()──> requests whose grammar is done (or failed, or past the deadline)

A request waits here, outside the scheduler, until its grammar is compiled: the batch runs on
meanwhile. A compile past `compile_timeout_s` fails its request (a 400 naming the parameter); the
thread finishes it anyway (llguidance bounds the work with its parser limits, text.grammar).
The first task builds the compiler itself (the tokenizer's token trie, ~1 s), so an engine's
start does not wait for it and the first constrained request does.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from native_backend.config.engine import GrammarOptions
from native_backend.text.grammar import Grammar, GrammarCompiler
from native_backend.text.grammar_spec import GrammarSpec


@dataclass
class GrammarStats:
    compiles: int = 0  # grammars compiled (cache misses)
    cache_hits: int = 0  # requests served a grammar compiled before (or compiling for another)
    failures: int = 0  # specs the library refused or that ran past the deadline
    compile_seconds: float = 0.0  # time spent compiling, all compiles together


class GrammarService:
    def __init__(self, make_compiler: Callable[[], GrammarCompiler], options: GrammarOptions = GrammarOptions()):
        """`options`: the size limit, compile deadline and cache size (EngineConfig.grammar; a
        gateway sets them from its server.limits)."""
        self.compile_timeout_s = options.compile_timeout_s
        self.max_bytes = options.max_bytes
        self.stats = GrammarStats()
        self._cache_size = options.cache_size
        self._done: OrderedDict[tuple, Grammar] = OrderedDict()  # LRU of compiled grammars
        self._compiling: dict[tuple, concurrent.futures.Future] = {}
        self._lock = threading.Lock()  # the worker thread finishes futures, the step loop reads
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvgate-grammar")
        self._compiler = self._pool.submit(make_compiler)

    def submit(self, spec: GrammarSpec) -> concurrent.futures.Future:
        """A future of the compiled grammar. Raises GrammarError at once for a spec that is
        malformed or over the size limit."""
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
                return future
            future = self._compiling[key] = self._pool.submit(self._compile, spec)
            return future

    def _compile(self, spec: GrammarSpec) -> Grammar:
        started = time.perf_counter()
        try:
            grammar = self._compiler.result().compile(spec)
        except BaseException:
            with self._lock:
                self.stats.failures += 1
                self._compiling.pop(spec.key, None)
            raise
        with self._lock:
            self.stats.compiles += 1
            self.stats.compile_seconds += time.perf_counter() - started
            self._compiling.pop(spec.key, None)
            self._done[spec.key] = grammar
            while len(self._done) > self._cache_size:
                self._done.popitem(last=False)
        return grammar

    def note_timeout(self) -> None:
        with self._lock:
            self.stats.failures += 1

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _done_future(value) -> concurrent.futures.Future:
    future = concurrent.futures.Future()
    future.set_result(value)
    return future
