"""The engine core: schedule, execute, update. It runs in the engine process, single-threaded.

    add_request ──> Scheduler (waiting) ──schedule()──> SchedulerOutput ──Executor.execute()──>
    RunnerOutput ──Scheduler.update()──> StepResults ──> CoreOutputs (token ids, never text)

A constrained request (EngineRequest.grammar) first waits outside the scheduler for its grammar,
compiled on a worker thread (core.grammars), while the batch runs on; then it joins the scheduler
with its own matcher. A constraint the library refuses ends it before any token (EngineError
"invalid" naming the request parameter).

A pooling request (EngineRequest.pooling: an embedding) takes the same path, prefill only: the
scheduler runs its prompt in the budget of ordinary steps (so it never stalls the decodes in
flight), the runner pools its hidden states, and its one output carries the vector.

Pipeline parallelism (executor.max_concurrent_batches P > 1): the step keeps up to P batches in
flight (vLLM's batch queue): while fewer are, it schedules one more from the requests not in
flight and submits it (stage 0 runs it and hands it on); once P are (or nothing more can be
scheduled) it collects the oldest batch's output and updates the scheduler with it. So stage 0
works on batch n + 1 while the later stages finish batch n.

    stage 0:  [b1][b2][b3][b1'][b2']...       b1' = the requests of b1, one token further
    stage 1:      [b1][b2][b3][b1']...
    stage 2:          [b1][b2][b3]...

The core never touches the model: the executor builds it, owns it and runs it. The engine is
handed its executor (process.factory builds both), so the core imports nothing of execution.
Nor does it hold text: the process's output processor (process/output_processor.py) turns each
CoreOutput into text and ends a request whose text hits a stop string (`finish`). Grammars are
token masks, not text: the core compiles them with the compiler that process.factory binds to the
engine process's tokenizer.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

from native_backend.config.engine import EngineConfig
from native_backend.core.grammars import GrammarService
from native_backend.core.interface import CoreOutput, EngineError, EngineRequest, EngineStats, LoRAStats
from native_backend.core.kv_connector import KVConnectorScheduler, KVTransferPort
from native_backend.core.kv_events import KVEvent
from native_backend.core.scheduler import ContextLengthError, Scheduler, SchedulerConfig, StepResult
from native_backend.core.sequence import FinishReason, Sequence
from native_backend.core.spec_policy import speculation_policy
from native_backend.core.spec_stats import SpecDecodeStats, engine_stats_fields, trace_marks
from native_backend.text.grammar import GrammarCompiler
from native_backend.text.grammar_spec import GrammarError, GrammarSpec, short

log = logging.getLogger("kvgate.engine")


@dataclass
class _Milestones:
    """A request's milestones for its trace (unix seconds, and counters)."""

    arrived: float = 0.0
    scheduled: float | None = None
    first_token: float | None = None
    prefill_chunks: int = 0
    # Prompt tokens this engine ran through the model before the first token: neither its prefix
    # cache's hits nor a producer's blocks it read (a consumer that read a prompt computes the rest).
    computed_prompt_tokens: int = 0
    # A consumer's read of its prompt's KV: "kv_transfer_started", "kv_transfer_ended" (unix s),
    # "kv_transfer_tokens", "kv_transfer_bytes", "kv_transfer_failed" (1: the prompt was recomputed).
    kv_transfer: dict[str, float] = field(default_factory=dict)

    def timings(self, finished: float, preemptions: int, cached_tokens: int) -> dict[str, float]:
        marks = {"arrived": self.arrived, "scheduled": self.scheduled, "first_token": self.first_token,
                 "finished": finished, "prefill_chunks": self.prefill_chunks,
                 "computed_prompt_tokens": self.computed_prompt_tokens, "preemptions": preemptions,
                 "cached_tokens": cached_tokens, **self.kv_transfer}
        return {k: float(v) for k, v in marks.items() if v is not None}


@dataclass
class _AwaitingGrammar:
    """A constrained request whose grammar is compiling: it joins the scheduler when it is done."""

    seq: Sequence
    spec: GrammarSpec
    future: concurrent.futures.Future


GRAMMAR_POLL_S = 0.02  # with nothing else to run, how long a step waits for a grammar to finish
KV_POLL_S = 0.005  # with only remote KV reads in flight, how long a step waits for one to end


class LLMEngine:
    def __init__(self, config: EngineConfig, executor, kv_events: Callable[[list[KVEvent]], None] | None = None,
                 *, extra_eos_token_ids: Iterable[int] = (),
                 grammar_compiler: Callable[[int, int | None], GrammarCompiler] | None = None,
                 kv_transfer: KVTransferPort | None = None):
        """`executor`: execution.executor.Executor built for `config` (execution.factory.make_executor).
        `kv_events`: where the prefix cache's changes go after each step (process.kv_publisher).
        `extra_eos_token_ids`: ids that also end a request, beyond the model config's (the
        tokenizer's generation_config.json; process.factory reads them). `grammar_compiler(vocab_size,
        eos_token_id)`: builds the compiler of constrained requests' grammars over the engine
        process's tokenizer (process.factory binds it); None: constrained requests are refused.
        `kv_transfer`: the KV connector's worker side (execution.kv_transfer) when the config has a
        kv_role: prefill/decode disaggregation (core.kv_connector)."""
        self.config = config
        self.executor = executor
        self.model_config = self.executor.model_config
        self.max_model_len = self.executor.max_model_len
        self.plan = self.executor.plan
        self.eos_token_ids = tuple(dict.fromkeys([*self.model_config.eos_token_ids, *extra_eos_token_ids]))
        role = config.transfer.kv_role
        self.kv = KVConnectorScheduler(role, kv_transfer, config.transfer.kv_hold_timeout_s) if role else None
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_seqs=config.scheduler.max_num_seqs,
            max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
            long_prefill_token_threshold=config.scheduler.long_prefill_token_threshold,
            block_size=config.cache.block_size,
            num_blocks=self.plan.num_blocks,
            max_model_len=self.max_model_len,
            enable_prefix_caching=config.cache.enable_prefix_caching,
            eos_token_id=self.eos_token_ids[0] if self.eos_token_ids else None,
            prefix_hash_seed=config.cache.prefix_hash_seed,
            record_kv_events=kv_events is not None,
            max_loras=config.lora.max_loras if config.lora.enable_lora else 0,
        ), speculation_policy(config.speculative, executor.count_drafts if config.speculative else None), self.kv)
        self._milestones: dict[str, _Milestones] = {}
        self._grammar_compiler = grammar_compiler
        self._grammars: GrammarService | None = None  # made on the first constrained request
        self._awaiting: dict[str, _AwaitingGrammar] = {}
        self.num_steps = 0
        self.num_step_tokens = 0
        self.step_seconds = 0.0
        self.num_failed_requests = 0  # failed alone (their fault) while the others went on
        self._in_flight: deque = deque()  # pipeline parallelism: (SchedulerOutput, its request ids) submitted
        self._kv_events = kv_events
        self._publish_kv_events()  # AllBlocksCleared: a subscriber forgets what an earlier engine held

    def describe(self) -> str:
        return self.executor.describe()

    # ------------------------------------------------------------------ requests

    def add_request(self, request: EngineRequest) -> None:
        request.check(self.model_config.vocab_size)  # what would fail inside a batched step
        sampling = request.sampling
        extra_eos = tuple(t for t in self.eos_token_ids[1:] if t not in sampling.stop_token_ids)
        if extra_eos and not sampling.ignore_eos:  # models that end on several ids (SmolLM2: two)
            sampling = replace(sampling, stop_token_ids=tuple(sampling.stop_token_ids) + extra_eos)
        seq = Sequence(request.request_id, request.prompt_token_ids, sampling, request.priority,
                       pooling=request.pooling, cache_salt=request.cache_salt, lora_name=request.lora_name)
        self._check_lora(request.lora_name)
        try:
            if self.kv is not None:
                self.kv.mark(seq, request.kv_transfer_params)
            if request.grammar is None:
                self.scheduler.add(seq)  # the lengths are checked there, once (scheduler.check_request_fits)
            else:
                self._await_grammar(seq, request.grammar)
        except ContextLengthError as exc:
            raise EngineError("context_length", str(exc)) from None
        except ValueError as exc:  # GrammarError included: a malformed or oversized constraint
            raise EngineError("invalid", str(exc)) from None
        self._milestones[request.request_id] = _Milestones(arrived=request.arrival_time)

    def _await_grammar(self, seq: Sequence, spec: GrammarSpec) -> None:
        """Refuse now what is wrong without compiling (lengths, size), then queue the compile."""
        if seq.request_id in self._awaiting:
            raise ValueError(f"duplicate request id {seq.request_id!r}")
        self.scheduler.check(seq)
        grammars = self._grammar_service()
        self._awaiting[seq.request_id] = _AwaitingGrammar(seq, spec, grammars.submit(spec))

    def _grammar_service(self) -> GrammarService:
        if self._grammar_compiler is None:
            raise ValueError("this engine was built without a grammar compiler: constrained output is unavailable")
        if self._grammars is None:
            make, vocab_size = self._grammar_compiler, self.model_config.vocab_size
            eos = self.eos_token_ids[0] if self.eos_token_ids else None
            self._grammars = GrammarService(lambda: make(vocab_size, eos), self.config.grammar)
        return self._grammars

    def _check_lora(self, name: str | None) -> None:
        """An adapter the engine does not hold is the caller's mistake, refused before it queues."""
        if name is None:
            return
        lora = getattr(self.executor, "lora", None)
        if lora is None:
            raise EngineError("invalid", f"LoRA adapter '{name}': this engine runs without enable_lora")
        if name not in lora.paths:
            raise EngineError("invalid", f"LoRA adapter '{name}' is not loaded")

    def add_lora(self, name: str, path: str) -> None:
        """Load (or replace an idle) adapter; EngineError "invalid" names what is wrong with it. The
        manager refuses a bad adapter with its LoRAError, a ValueError: caught as that, since the core
        (torch-free) does not import the model layer that defines it."""
        lora = getattr(self.executor, "lora", None)
        if lora is None:
            raise EngineError("invalid", "this engine runs without enable_lora")
        try:
            lora.add(name, path, in_use=self._adapters_in_use())
        except ValueError as exc:
            raise EngineError("invalid", str(exc)) from None

    def remove_lora(self, name: str) -> None:
        """Unload an adapter (vLLM's /v1/unload_lora_adapter); EngineError "invalid" when it is not
        loaded or an unfinished request (running, waiting, or waiting for its grammar) uses it:
        those would otherwise fail mid-way."""
        lora = getattr(self.executor, "lora", None)
        if lora is None:
            raise EngineError("invalid", "this engine runs without enable_lora")
        if name in self._adapters_in_use():
            raise EngineError("invalid", f"LoRA adapter '{name}' is in use by unfinished requests")
        try:
            lora.remove(name)
        except ValueError as exc:
            raise EngineError("invalid", str(exc)) from None

    def _adapters_in_use(self) -> set[str]:
        seqs = [*self.scheduler.requests.values(), *(a.seq for a in self._awaiting.values())]
        return {s.lora_name for s in seqs if s.lora_name is not None}

    def _lora_stats(self) -> dict:
        """vLLM's lora_requests_info fields (its adapters of running and of waiting requests) and
        the served adapters' directories; nothing without enable_lora."""
        lora = getattr(self.executor, "lora", None)
        if lora is None:
            return {}
        running = {s.lora_name for s in self.scheduler.running} - {None}
        waiting = ({s.lora_name for s in self.scheduler.requests.values()} - running - {None}
                   | {a.seq.lora_name for a in self._awaiting.values()} - {None})
        return {"lora": LoRAStats(max_loras=self.config.lora.max_loras,
                                  adapters=dict(lora.paths),
                                  running=tuple(sorted(running)), waiting=tuple(sorted(waiting)))}

    def abort(self, request_id: str) -> None:
        self.scheduler.abort(request_id)
        waiting = self._awaiting.pop(request_id, None)
        if waiting is not None:  # its compile, not started yet and wanted by no one else, is cancelled
            self._grammars.release(waiting.spec)
        self._milestones.pop(request_id, None)

    def release_kv(self, engine_id: str, request_id: str) -> None:
        """A producer frees the blocks it holds unread for `request_id`: the gateway knows no
        consumer will read them (interface.EngineCoreProtocol.release_kv)."""
        if self.kv is not None:
            self.scheduler.release_hold(engine_id, request_id)

    def finish(self, request_id: str, reason: FinishReason) -> dict[str, float] | None:
        """End a request for a reason found outside the core (its text hit a stop string) before
        it runs another step; return its trace timings (None: it had already ended)."""
        seq = self.scheduler.get(request_id)
        if seq is None or request_id not in self._milestones:
            return None
        timings = self._final_timings(request_id, seq.num_preemptions, seq.num_cached_tokens,
                                      self.scheduler.speculation.request_counts(seq))
        self.scheduler.finish(request_id, reason)
        return timings

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._awaiting) or bool(self._in_flight)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix now (running requests keep their own KV) and publish
        AllBlocksCleared, so routers drop what they knew this engine held."""
        self.scheduler.block_manager.reset_prefix_cache()
        self._publish_kv_events()

    # ------------------------------------------------------------------ the loop

    def step(self) -> list[CoreOutput]:
        """Schedule, execute, update: what each request advanced by, in token ids."""
        started = time.monotonic()
        refused = self._admit_compiled() if self._awaiting else []
        if self.kv is not None:
            self._finish_kv_loads()
        if self.executor.max_concurrent_batches > 1:
            return refused + self._step_pipelined(started)
        if not self.scheduler.has_unfinished():  # only grammars compiling: wait for one, do not spin
            self._wait_for_grammars()
            return refused
        scheduled = self.scheduler.schedule()
        if scheduled.kv_loads:
            self._start_kv_loads(scheduled.kv_loads)
        if scheduled.is_empty:  # only reads of remote KV in flight: wait for one, do not spin
            self.scheduler.report_again(scheduled.finished_request_ids)
            if self.kv is not None:
                self.kv.port.wait(KV_POLL_S)
            return refused
        self._note_prefill(scheduled)
        runner_output = self.executor.execute(scheduled)
        return refused + self._apply(scheduled, runner_output, started)

    def _apply(self, scheduled, runner_output, started: float) -> list[CoreOutput]:
        """Update the scheduler with a step's output: what each request advanced by."""
        results = self.scheduler.update(scheduled, runner_output)
        self._publish_kv_events()
        outputs = [self._to_output(r) for r in results if r.request_id in self._milestones]
        self.num_steps += 1
        self.num_step_tokens += scheduled.num_batched_tokens
        self.step_seconds += time.monotonic() - started
        return outputs

    def _step_pipelined(self, started: float) -> list[CoreOutput]:
        """Submit one more batch while fewer than P are in flight; else (or with nothing to
        schedule) collect the oldest one's output and update with it."""
        depth = self.executor.max_concurrent_batches
        if len(self._in_flight) < depth and self.scheduler.has_unfinished():
            busy = {rid for _, ids in self._in_flight for rid in ids}
            share = -(-len(self.scheduler.requests) // depth)  # each step in flight a 1/P share of the requests
            scheduled = self.scheduler.schedule(busy, max_chunks=max(share, 1))
            if scheduled.kv_loads:
                self._start_kv_loads(scheduled.kv_loads)
            if not scheduled.is_empty:
                self._note_prefill(scheduled)
                self.executor.submit(scheduled)
                self._in_flight.append((scheduled, [c.request_id for c in scheduled.chunks]))
                if len(self._in_flight) < depth:
                    return []  # room for another batch: schedule it before waiting on this one
            else:
                self.scheduler.report_again(scheduled.finished_request_ids)
        if not self._in_flight:  # nothing runs: grammars compiling, or only remote KV reads
            if self._awaiting:
                self._wait_for_grammars()
            elif self.kv is not None:
                self.kv.port.wait(KV_POLL_S)
            return []
        scheduled, _ = self._in_flight.popleft()
        return self._apply(scheduled, self.executor.collect(), started)

    def _start_kv_loads(self, loads) -> None:
        now = time.time()
        for load in loads:
            self._milestones[load.request_id].kv_transfer["kv_transfer_started"] = now
        self.kv.port.start_loads(loads)

    def _finish_kv_loads(self) -> None:
        """Reads that ended: a complete one is copied into its blocks and its request runs on
        from them; a failed one (refused, timed out, the producer gone) recomputes its prompt."""
        for result in self.kv.port.take_finished():
            ok = result.ok
            if ok and self.scheduler.loading.get(result.load.request_id, (None, None))[1] is result.load:
                try:
                    self.kv.port.commit(result)
                except Exception as exc:  # noqa: BLE001 - a bad payload is that read's failure
                    ok, result.error = False, f"{type(exc).__name__}: {exc}"
            if self.scheduler.remote_load_finished(result.load, ok) is None:
                continue  # the request ended while its blocks were read
            result.ok = ok
            self.kv.finished(result)
            self._note_kv_transfer(result)

    def _note_kv_transfer(self, result) -> None:
        marks = self._milestones[result.load.request_id].kv_transfer
        marks["kv_transfer_ended"] = time.time()
        if result.ok:
            marks.update(kv_transfer_tokens=result.load.moved_tokens, kv_transfer_bytes=result.nbytes)
        else:
            marks["kv_transfer_failed"] = 1
            log.warning("request %s: reading its prompt's KV from %s:%s failed (%s); recomputing it",
                        result.load.request_id, result.load.source.host, result.load.source.port, result.error)

    def _publish_kv_events(self) -> None:
        if self._kv_events is not None:
            events = self.scheduler.block_manager.take_kv_events()
            if events:
                self._kv_events(events)

    def _admit_compiled(self) -> list[CoreOutput]:
        """Requests whose grammar is ready join the scheduler; those whose constraint failed to
        compile (or ran past the deadline) end here, before any token: their outputs."""
        refused, now = [], time.monotonic()
        for request_id, waiting in list(self._awaiting.items()):
            if waiting.future.done():
                del self._awaiting[request_id]
                self._grammars.release(waiting.spec)
                error = self._join_scheduler(waiting)
            elif self._grammars.expired(waiting.spec, now):
                del self._awaiting[request_id]
                self._grammars.release(waiting.spec)
                self._grammars.note_timeout()
                error = EngineError("invalid", f"{waiting.spec.param}: compiling the constraint took longer than "
                                    f"{self._grammars.compile_timeout_s:g} s")
            else:
                continue
            if error is not None:
                self._milestones.pop(request_id, None)
                refused.append(CoreOutput(request_id, [], finish_reason="abort", error=error,
                                          num_prompt_tokens=waiting.seq.num_prompt_tokens))
        return refused

    def _join_scheduler(self, waiting: _AwaitingGrammar) -> EngineError | None:
        try:
            waiting.seq.grammar = waiting.future.result().matcher()
            self.scheduler.add(waiting.seq)
        except (GrammarError, ValueError) as exc:
            return EngineError("invalid", str(exc))
        except Exception as exc:  # noqa: BLE001 - the compiler broke on this constraint: it fails alone
            reason = short(f"{type(exc).__name__}: {exc}")  # the library may quote the whole schema
            log.warning("compiling %s for request %s failed: %s", waiting.spec.param, waiting.seq.request_id, reason)
            return EngineError("internal", f"compiling the constraint failed: {reason}")
        return None

    def _wait_for_grammars(self) -> None:
        futures = [w.future for w in self._awaiting.values()]
        concurrent.futures.wait(futures, timeout=GRAMMAR_POLL_S, return_when=concurrent.futures.FIRST_COMPLETED)

    def _note_prefill(self, scheduled) -> None:
        now = time.time()
        for chunk in scheduled.chunks:
            state = self._milestones.get(chunk.request_id)
            if state is not None and state.first_token is None:
                state.scheduled = state.scheduled or now
                state.prefill_chunks += 1
                state.computed_prompt_tokens += len(chunk.token_ids)

    def _to_output(self, result: StepResult) -> CoreOutput:
        if result.error is not None:
            return self._failed_alone(result)
        marks = self._milestones[result.request_id]
        if marks.first_token is None and result.new_token_ids:
            marks.first_token = time.time()
        timings = None
        if result.finished:
            timings = self._final_timings(result.request_id, result.num_preemptions, result.num_cached_tokens,
                                          result.spec_decode)
        return CoreOutput(
            request_id=result.request_id,
            new_token_ids=list(result.new_token_ids),
            finish_reason=result.finish_reason,
            logprobs=result.logprobs,
            num_prompt_tokens=result.num_prompt_tokens,
            num_cached_tokens=result.num_cached_tokens,
            num_output_tokens=result.num_output_tokens,
            timings=timings,
            embedding=result.embedding,
            kv_transfer_params=result.kv_transfer_params,
        )

    def _failed_alone(self, result: StepResult) -> CoreOutput:
        """A failure of the request's own (its sampling) ends that request alone."""
        log.warning("request %s failed alone: %s", result.request_id, short(result.error))
        self.num_failed_requests += 1
        if result.failed_grammar is not None and self._grammars is not None:
            self._grammars.evict(result.failed_grammar)  # a matcher errored on it: not served again
        self.scheduler.finish(result.request_id, "abort")  # no-op if it already ended
        self._milestones.pop(result.request_id, None)
        return CoreOutput(result.request_id, [], finish_reason="abort", num_prompt_tokens=result.num_prompt_tokens,
                          num_output_tokens=result.num_output_tokens,
                          error=EngineError(result.error_kind, result.error))

    def _final_timings(self, request_id: str, preemptions: int, cached_tokens: int,
                       spec_counts: SpecDecodeStats | None) -> dict[str, float]:
        """The ended request's trace timings; it leaves the core's bookkeeping."""
        timings = self._milestones.pop(request_id).timings(time.time(), preemptions, cached_tokens)
        timings.update(trace_marks(spec_counts))
        return timings

    def stats(self) -> EngineStats:
        # Called every stats interval, idle or not: a tensor-parallel worker that died raises here,
        # and the engine process reports it as fatal and exits (its supervisor restarts it).
        self.executor.check_health()
        s = self.scheduler.stats()
        clamped_keys, clamped_values = self.executor.kv_clamped()
        return EngineStats(
            num_waiting=s.num_waiting + len(self._awaiting),
            num_running=s.num_running,
            kv_cache_usage=s.kv_cache_usage,
            kv_blocks_total=self.plan.num_blocks,
            kv_blocks_used=round(s.kv_cache_usage * self.plan.num_blocks),
            prefix_cache_queries=s.prefix_cache_queries,
            prefix_cache_hits=s.prefix_cache_hits,
            num_preemptions=s.num_preemptions,
            num_steps=self.num_steps,
            num_step_tokens=self.num_step_tokens,
            step_seconds=self.step_seconds,
            num_failed_requests=self.num_failed_requests,
            block_size=self.plan.block_size,
            kv_cache_dtype=self.config.kv_cache_dtype,
            weights=self.executor.weights,
            cpu_kernels=self.executor.kernel_path,
            prefill=self.executor.prefill_path,
            max_model_len=self.max_model_len,
            kv_clamped_keys=clamped_keys,
            kv_clamped_values=clamped_values,
            **engine_stats_fields(s.spec_decode),
            **self._grammar_stats(),
            **(dict(num_waiting_for_remote_kv=s.num_waiting_for_remote_kv, **self.kv.stats()) if self.kv else {}),
            **self._lora_stats(),
        )

    def _grammar_stats(self) -> dict:
        if self._grammars is None:
            return {}
        g = self._grammars.stats
        return dict(grammar_compiles=g.compiles, grammar_cache_hits=g.cache_hits, grammar_failures=g.failures,
                    grammar_compile_seconds=g.compile_seconds, num_waiting_for_grammar=len(self._awaiting))

