"""Continuous batching with chunked prefill, prefix caching and preemption by recompute.

Each step the scheduler answers one question: which tokens of which requests run now, under a
token budget (max_num_batched_tokens) and a sequence budget (max_num_seqs)?

    1. running requests, decodes first (1 token each), then continuing prefill chunks;
       a request that needs a block when none is free preempts the least important running
       request (highest priority number, then latest arrival) -- possibly itself;
    2. admission: waiting requests in (priority, arrival) order take the leftover budget, their
       first chunk starting after whatever prefix the cache already holds. Admission stops at
       the first request that does not fit (no overtaking) and is skipped in a step that had to
       preempt (the cache is full: admitting now would only preempt again).

A preempted request keeps its output tokens; when readmitted it re-prefills prompt + output
(often partly from the prefix cache) and carries on where it stopped.

With speculative decoding (a `SpeculationPolicy`), a decoding request may get k draft slots (as
many as its proposer has drafts for, at most the configured k): it takes 1 + k tokens of the budget and KV slots for all of them, but never preempts anyone for the
drafts (without free blocks it decodes plainly). The scheduler never sees a draft before the
runner's counts: the chunk names the proposer (execution side) that fills the slots. A
constrained request (one with a grammar) never speculates: its drafts would need the grammar's
mask at every draft position.

Constrained decoding: once the batch is formed, each sampling chunk of a constrained request gets
its grammar's bitmask of allowed next tokens (`token_bitmask`; the sampler masks that row's
logits with it); `update()` advances the grammar past every appended token.

`update()` applies the runner's sampled tokens, advances KV progress (rolling back the slots of
drafts not accepted), registers newly full blocks in the prefix cache, and detects the end of a request.

Steps in flight (pipeline parallelism: the engine core keeps up to P steps running): schedule()
is told the requests whose last step has not come back (`busy`); it skips them (their next tokens
depend on it) and never preempts one (a step in flight is still writing its blocks), so each
step in flight holds other requests, and update() applies the steps in the order they ran.
`max_chunks` caps a step's requests (the engine asks for a 1/P share of them), so that the
running requests spread over the P steps instead of the first step taking them all.

Pooling requests (embeddings, `Sequence.pooling`) are scheduled like any prompt (chunked, within
the budget, preemptible) but never sampled and never speculated on: the step that runs their last
prompt token ends them with the runner's pooled vector and frees their KV. Mean pooling needs
every token's hidden state, so it never starts from a cached prefix; last-token pooling does.

Prefill/decode disaggregation (core.kv_connector): a consumer's request with remote KV is admitted
to WAITING_FOR_REMOTE_KV (blocks allocated past its cached prefix, the read handed to the worker
in `SchedulerOutput.kv_loads`), never scheduled until its read ends (`remote_load_finished`), so
the batch runs on meanwhile (the worker writes the blocks as they arrive, beside the steps: a
request that ends while its read runs keeps its blocks until the read ends, `reads_ended_after`,
so no other request is handed blocks still being written); a producer's prefill for a remote
decode keeps its blocks when it ends (`_end`), until its consumer has read them or they expire.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import time
from dataclasses import dataclass, field

import numpy as np

from native_backend.core.batch import (NO_DRAFTS, DraftCounts, RunnerOutput, SampledLogprobs, ScheduledChunk,
                                       SchedulerOutput)
from native_backend.core.block_manager import BlockManager
from native_backend.core.kv_connector import KVConnectorScheduler
from native_backend.core.kv_params import KVLoad
from native_backend.core.sequence import FinishReason, Sequence, SequenceStatus
from native_backend.core.spec_policy import NoSpeculation, SpeculationPolicy
from native_backend.core.spec_stats import SpecDecodeStats
from native_backend.text.grammar_spec import GrammarSpec, is_limit_error, limit_message, short


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256  # most requests running (holding KV) at once
    max_num_batched_tokens: int = 2048  # tokens computed per step, all requests together
    # One prompt's most tokens in a step (0: the whole budget). Below the budget it leaves room
    # in every step for others: a short prompt is admitted beside a long prompt's chunks instead
    # of waiting for all of them (vLLM's long_prefill_token_threshold).
    long_prefill_token_threshold: int = 0
    block_size: int = 16  # token slots per KV block
    num_blocks: int = 1024  # KV blocks in the cache
    max_model_len: int = 2048  # prompt + output tokens of one request, at most
    enable_prefix_caching: bool = True
    eos_token_id: int | None = None  # the model's end-of-sequence token (per request override)
    prefix_hash_seed: str = "0"  # seeds the prefix cache's chained block hashes (vLLM's PYTHONHASHSEED)
    record_kv_events: bool = False  # keep the prefix cache's changes for a KV-event publisher
    # LoRA slots: adapters among the running requests at most (vLLM's max_loras); 0: LoRA off.
    # A request whose adapter would need one more waits until a running adapter's requests end.
    max_loras: int = 0

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "num_blocks", "max_model_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be 0 or positive, got {self.long_prefill_token_threshold}")


class GrammarViolation(RuntimeError):
    """A sampled token the request's grammar refuses (the mask should have made it impossible),
    or a matcher past one of llguidance's work limits (`limit`: the client's constraint is too
    complex, a 400): that request fails alone, and its grammar leaves the cache."""

    def __init__(self, message: str, limit: bool = False):
        super().__init__(message)
        self.limit = limit


def _violation(grammar, token_id: int) -> GrammarViolation:
    error = grammar.error
    if is_limit_error(error):
        param = grammar.spec.param if grammar.spec is not None else "constraint"
        return GrammarViolation(limit_message(param, error), limit=True)
    return GrammarViolation(f"token {token_id} is outside the grammar: {short(error)}")


class ContextLengthError(ValueError):
    """A request longer than the context or the cache could ever hold: the client's to shorten."""


def check_request_fits(num_prompt_tokens: int, max_tokens: int | None, *, max_model_len: int, cache_slots: int) -> None:
    """The one place that decides whether a request's lengths can ever be served.

    - the prompt plus the tokens asked for (at least one) must fit the context length;
    - alone in the cache, the request must fit at its longest (else preemption could not help);
      the last sampled token is never fed back, so its KV slot is never needed."""
    if num_prompt_tokens == 0:
        raise ValueError("The prompt is empty.")
    wanted = max_tokens or 1
    if num_prompt_tokens + wanted > max_model_len:
        raise ContextLengthError(
            f"This model's maximum context length is {max_model_len} tokens (max_model_len). However, you "
            f"requested {num_prompt_tokens + wanted} tokens ({num_prompt_tokens} in the prompt, {wanted} for the "
            f"completion).")
    longest = min(num_prompt_tokens + (max_tokens or max_model_len), max_model_len) - 1
    if longest > cache_slots:
        raise ContextLengthError(
            f"The prompt ({num_prompt_tokens} tokens) plus max_tokens needs {longest} KV slots, more than this "
            f"engine's whole cache holds ({cache_slots} tokens).")


def check_pooling_fits(num_prompt_tokens: int, *, max_model_len: int, cache_slots: int) -> None:
    """A pooling request generates nothing: its prompt alone must fit the context and the cache."""
    if num_prompt_tokens == 0:
        raise ValueError("The prompt is empty.")
    if num_prompt_tokens > max_model_len:
        raise ContextLengthError(
            f"This model's maximum context length is {max_model_len} tokens (max_model_len). However, the "
            f"input has {num_prompt_tokens} tokens.")
    if num_prompt_tokens > cache_slots:
        raise ContextLengthError(f"The input ({num_prompt_tokens} tokens) needs more KV slots than this engine's "
                                 f"whole cache holds ({cache_slots} tokens).")


def fitted_max_tokens(num_prompt_tokens: int, bound: int, *, max_model_len: int, cache_slots: int) -> int:
    """A default max_tokens (the client named none): the bound, lowered to what the context leaves
    and what the cache holds for this prompt alone; at least 1, so a prompt that leaves nothing
    is refused by check_request_fits with its own message."""
    room = min(max_model_len - num_prompt_tokens, cache_slots + 1 - num_prompt_tokens)
    return max(1, min(bound, room))


@dataclass
class StepResult:
    """What one request produced in one step (returned by Scheduler.update)."""

    request_id: str
    # Tokens appended this step. When finish_reason is "stop" the last one is the EOS/stop token
    # (the output processor decides whether to show it).
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    logprobs: list[SampledLogprobs] | None = None  # one per new token, if the request asked
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # all output tokens so far, including new_token_ids
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (usage details)
    num_preemptions: int = 0  # times this request was preempted so far
    error: str | None = None  # set when the request failed alone (finish_reason "abort")
    error_kind: str = "internal"  # its EngineError kind: "invalid" when the client's constraint is to blame
    failed_grammar: GrammarSpec | None = None  # the grammar whose matcher errored (evicted from the cache)
    embedding: list[float] | None = None  # a pooling request's vector, on its one (finished) result
    spec_decode: SpecDecodeStats | None = None  # this request's speculation so far (None: speculation is off)
    # A prefill for a remote decode that ended holding its blocks: where a consumer reads them.
    kv_transfer_params: dict | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class SchedulerStats:
    num_waiting: int
    num_running: int
    kv_cache_usage: float  # fraction of KV blocks in use, 0..1
    prefix_cache_queries: int  # tokens looked up in the prefix cache
    prefix_cache_hits: int  # of those, tokens found
    num_preemptions: int  # total since start
    spec_decode: SpecDecodeStats | None = None  # None: speculation is off
    num_waiting_for_remote_kv: int = 0  # admitted, reading their prompt's KV from a producer


class WaitingQueue:
    """Waiting and preempted requests in admission order: (priority, arrival_time, arrival_index)."""

    def __init__(self) -> None:
        self._seqs: list[Sequence] = []

    def push(self, seq: Sequence) -> None:
        bisect.insort(self._seqs, seq, key=lambda s: s.sort_key)

    def peek(self) -> Sequence:
        return self._seqs[0]

    def pop(self) -> Sequence:
        return self._seqs.pop(0)

    def remove(self, seq: Sequence) -> None:
        self._seqs.remove(seq)

    def __len__(self) -> int:
        return len(self._seqs)

    def __iter__(self):
        return iter(self._seqs)


@dataclass
class _StepPlan:
    """The batch being formed in one schedule() call."""

    token_budget: int
    busy: frozenset[str] | set[str] = frozenset()  # requests with a step in flight: not in this one
    max_chunks: int | None = None  # most requests in this step (steps in flight share them)

    @property
    def full(self) -> bool:
        return self.token_budget <= 0 or (self.max_chunks is not None and len(self.chunks) >= self.max_chunks)
    chunks: dict[str, ScheduledChunk] = field(default_factory=dict)  # in schedule order
    preempted: list[str] = field(default_factory=list)
    kv_loads: list[KVLoad] = field(default_factory=list)

    def add(self, chunk: ScheduledChunk) -> None:
        self.chunks[chunk.request_id] = chunk
        self.token_budget -= len(chunk.token_ids) + chunk.num_spec_tokens

    def drop(self, request_id: str) -> None:
        """Un-schedule a request preempted after it got its chunk; its tokens return to the budget."""
        chunk = self.chunks.pop(request_id, None)
        if chunk is not None:
            self.token_budget += len(chunk.token_ids) + chunk.num_spec_tokens


class Scheduler:
    def __init__(self, config: SchedulerConfig, speculation: SpeculationPolicy | NoSpeculation | None = None,
                 kv: KVConnectorScheduler | None = None):
        self.config = config
        self.kv = kv  # prefill/decode disaggregation's connector (None: off)
        # Requests waiting for a producer's blocks (WAITING_FOR_REMOTE_KV), with their read.
        self.loading: dict[str, tuple[Sequence, KVLoad]] = {}
        # Requests that ended while their read ran: their blocks go back when the read ends.
        self.reads_ended_after: dict[int, tuple[KVLoad, Sequence]] = {}  # by id(KVLoad)
        self.speculation = speculation or NoSpeculation()
        self.block_manager = BlockManager(config.num_blocks, config.block_size, config.enable_prefix_caching,
                                          config.prefix_hash_seed, config.record_kv_events)
        self.requests: dict[str, Sequence] = {}  # every unfinished request, by id
        self.waiting = WaitingQueue()
        self.running: list[Sequence] = []  # in admission order
        self.num_preemptions = 0
        self._ended_since_last_step: list[str] = []
        self._arrival_counter = itertools.count()

    # --- requests in and out ---------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Queue a new request. Raises ValueError for one that could never run to completion."""
        self.check(seq)
        seq.resolve_limits(self.config.max_model_len, self.config.eos_token_id)
        seq.arrival_index = next(self._arrival_counter)
        seq.status = SequenceStatus.WAITING
        self.requests[seq.request_id] = seq
        self.waiting.push(seq)

    def check(self, seq: Sequence) -> None:
        """Raise ValueError (ContextLengthError for lengths) for a request that could never run;
        fits a default max_tokens to the context. add() calls it; a request that waits before
        joining (for its grammar) is checked on arrival too."""
        if seq.request_id in self.requests:
            raise ValueError(f"duplicate request id {seq.request_id!r}")
        c = self.config
        if seq.lora_name is not None and not c.max_loras:
            raise ValueError(f"LoRA adapter {seq.lora_name!r} asked of an engine without enable_lora")
        cache_slots = c.num_blocks * c.block_size
        if seq.pooling is not None:
            check_pooling_fits(seq.num_prompt_tokens, max_model_len=c.max_model_len, cache_slots=cache_slots)
            return
        if seq.sampling.max_tokens_default and seq.sampling.max_tokens is not None:
            seq.sampling = dataclasses.replace(seq.sampling, max_tokens=fitted_max_tokens(
                seq.num_prompt_tokens, seq.sampling.max_tokens, max_model_len=c.max_model_len, cache_slots=cache_slots))
        check_request_fits(seq.num_prompt_tokens, seq.sampling.max_tokens, max_model_len=c.max_model_len,
                           cache_slots=cache_slots)

    def abort(self, request_id: str) -> bool:
        """End a request now (client gone) and free its blocks (a read's once it stops writing
        them); a finished prefill's held for a remote decode too (its client left before it read
        the answer). False if unknown."""
        if self.finish(request_id, "abort"):
            return True
        return self.kv is not None and self.release_hold(self.kv.held.engine_id, request_id)

    def finish(self, request_id: str, reason: FinishReason) -> bool:
        """End a request for a reason found outside the scheduler (a stop string, an abort)."""
        seq = self.requests.get(request_id)
        if seq is None:
            return False
        if seq in self.running:
            self.running.remove(seq)
        elif (entry := self.loading.pop(request_id, None)) is not None:
            self.reads_ended_after[id(entry[1])] = (entry[1], seq)  # the worker may still be writing them
            self._end(seq, reason, free_blocks=False)
            return True
        else:
            self.waiting.remove(seq)
        self._end(seq, reason)
        return True

    def _end(self, seq: Sequence, reason: FinishReason, free_blocks: bool = True) -> None:
        """Every way out of the scheduler passes here: blocks back (or held for a remote
        decode, or kept until its read ends), runner told next step."""
        if free_blocks and not self._held_for_remote(seq, reason):
            self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        del self.requests[seq.request_id]
        self._ended_since_last_step.append(seq.request_id)

    def _held_for_remote(self, seq: Sequence, reason: FinishReason) -> bool:
        if self.kv is None or not seq.for_remote_decode:
            return False
        full = seq.num_computed_tokens // self.config.block_size
        return self.kv.hold_for_remote(seq, reason, self.block_manager.block_hashes(seq, full))

    def get(self, request_id: str) -> Sequence | None:
        return self.requests.get(request_id)

    def has_unfinished(self) -> bool:
        """Requests to run, reads of ended requests to wait out (their blocks come back then), or
        a producer's holds to free (served, or past their deadline)."""
        return bool(self.requests) or bool(self.reads_ended_after) or (
            self.kv is not None and self.kv.held is not None and self.kv.held.anything_to_free(time.monotonic()))

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def stats(self) -> SchedulerStats:
        bm = self.block_manager
        return SchedulerStats(
            num_waiting=self.num_waiting,
            num_running=self.num_running,
            kv_cache_usage=bm.usage(),
            prefix_cache_queries=bm.prefix_cache_queries,
            prefix_cache_hits=bm.prefix_cache_hits,
            num_preemptions=self.num_preemptions,
            spec_decode=self.speculation.stats,
            num_waiting_for_remote_kv=len(self.loading),
        )

    # --- batch formation -------------------------------------------------------------------

    def schedule(self, busy: frozenset[str] | set[str] = frozenset(), max_chunks: int | None = None) -> SchedulerOutput:
        """Form this step's batch: running requests first, then admissions (module docstring).
        `busy`: requests with a step in flight, left out (and never preempted); `max_chunks`: at
        most this many requests in the step (None: as many as the budgets allow)."""
        if self.kv is not None:
            self._free_holds()
        plan = _StepPlan(token_budget=self.config.max_num_batched_tokens, busy=busy, max_chunks=max_chunks)
        self._schedule_running(plan)
        if not plan.preempted:
            self._admit_waiting(plan)
        self._fill_token_bitmasks(plan)
        ended, self._ended_since_last_step = self._ended_since_last_step, []
        return SchedulerOutput(
            chunks=list(plan.chunks.values()),
            finished_request_ids=ended,
            preempted_request_ids=plan.preempted,
            kv_loads=plan.kv_loads,
        )

    def report_again(self, finished_request_ids: list[str]) -> None:
        """Ended requests of a step that did not run (nothing to compute): the next step reports them."""
        self._ended_since_last_step[:0] = finished_request_ids

    def _schedule_running(self, plan: _StepPlan) -> None:
        order = self._running_in_step_order()
        speculate = self.speculation.speculating(sum(1 for s in order if s.num_uncomputed_tokens == 1))
        for seq in order:
            if plan.full:
                return
            if seq.status is not SequenceStatus.RUNNING or seq.request_id in plan.busy:
                continue  # preempted earlier in this loop, or its last step is still in flight
            num_new = self._chunk_tokens(seq.num_uncomputed_tokens, plan.token_budget)
            drafts = speculate and seq.num_uncomputed_tokens == 1 and seq.grammar is None and seq.pooling is None
            num_slots = self._draft_slots(seq, plan) if drafts else 0
            if self._reserve_blocks(seq, num_new, plan):
                plan.add(self._make_chunk(seq, num_new, num_slots))

    def _chunk_tokens(self, num_uncomputed: int, token_budget: int) -> int:
        """A request's tokens this step: what it has left, within the budget and, for a prompt
        chunk, the long-prefill threshold."""
        cap = self.config.long_prefill_token_threshold
        return min(num_uncomputed, token_budget, cap if cap and num_uncomputed > 1 else num_uncomputed)

    def _draft_slots(self, seq: Sequence, plan: _StepPlan) -> int:
        """Draft slots for a decoding request, within the budget and the request's remaining
        output (a verification emits at most k + 1 tokens), holding blocks for them only if free
        ones are there: drafts never preempt."""
        room = min(plan.token_budget, seq.max_tokens - seq.num_output_tokens) - 1
        k = self.speculation.num_draft_slots(seq, room)
        if k and self.block_manager.can_allocate(seq, 1 + k):
            self.block_manager.allocate_slots(seq, 1 + k)
            return k
        return 0

    def _running_in_step_order(self) -> list[Sequence]:
        """Decodes first (cheap, latency-critical), then continuing prefills; each by importance."""
        by_key = sorted(self.running, key=lambda s: s.sort_key)
        decodes = [s for s in by_key if s.num_uncomputed_tokens == 1]
        prefills = [s for s in by_key if s.num_uncomputed_tokens > 1]
        return decodes + prefills

    def _reserve_blocks(self, seq: Sequence, num_new: int, plan: _StepPlan) -> bool:
        """Allocate KV slots for seq's next num_new tokens, preempting as needed.

        False when seq itself was the least important running request and got preempted.
        """
        while not self.block_manager.can_allocate(seq, num_new):
            victim = self._preemption_victim(plan.busy)
            if victim is None:
                return False  # every other running request has a step in flight: wait for one
            self._preempt(victim, plan)
            if victim is seq:
                return False
        self.block_manager.allocate_slots(seq, num_new)
        return True

    def _preemption_victim(self, busy: frozenset[str] | set[str] = frozenset()) -> Sequence | None:
        """The least important running request without a step in flight: highest priority
        number, then latest arrival; None when there is none."""
        return max((s for s in self.running if s.request_id not in busy), key=lambda s: s.sort_key, default=None)

    def _preempt(self, seq: Sequence, plan: _StepPlan) -> None:
        self.running.remove(seq)
        plan.drop(seq.request_id)
        plan.preempted.append(seq.request_id)
        self.block_manager.free(seq)  # its KV is recomputed on readmission; output tokens stay
        seq.status = SequenceStatus.PREEMPTED
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push(seq)

    def _fill_token_bitmasks(self, plan: _StepPlan) -> None:
        """The grammar's allowed next tokens for each constrained sampling chunk, filled once the
        batch is final (a chunk dropped by a later preemption would waste its fill)."""
        for chunk in plan.chunks.values():
            grammar = self.requests[chunk.request_id].grammar
            if chunk.sample and grammar is not None:
                chunk.token_bitmask = np.empty(grammar.num_words, dtype=np.int32)
                grammar.fill_bitmask(chunk.token_bitmask)

    def _admit_waiting(self, plan: _StepPlan) -> None:
        while self.waiting and not plan.full and len(self.running) + len(self.loading) < self.config.max_num_seqs:
            seq = self.waiting.peek()
            if seq.remote is not None:
                started = self._start_remote_load(seq, plan)
                if started is None:
                    return  # no room for its blocks: nobody overtakes it
                if started:
                    continue
            chunk = self._try_admit(seq, plan.token_budget)
            if chunk is None:
                if self._room_from_holds():
                    continue
                return  # the most important waiting request does not fit: nobody overtakes it
            plan.add(chunk)

    # --- prefill/decode disaggregation (core.kv_connector) -------------------------------------

    def _start_remote_load(self, seq: Sequence, plan: _StepPlan) -> bool | None:
        """Admit a consumer's request to wait for its prompt's blocks from the producer: blocks
        allocated for the full blocks past its own cached prefix (always short of the last
        prompt token, which runs here for its logit), the read handed to the worker. False:
        nothing worth reading (it is admitted as any request); None: no room yet."""
        bm, size, source = self.block_manager, self.config.block_size, seq.remote
        num_cached = bm.get_computed_prefix(seq)
        produced = source.num_tokens if source.num_tokens is not None else seq.num_prompt_tokens
        num_blocks = min(len(source.block_ids), (seq.num_prompt_tokens - 1) // size, produced // size)
        first = num_cached // size
        if num_blocks <= first:
            seq.remote = None
            return False
        num_tokens = num_blocks * size
        if not bm.can_allocate(seq, num_tokens - num_cached, num_cached):
            return None
        self.waiting.pop()
        bm.allocate_slots(seq, num_tokens - num_cached, num_cached)
        seq.num_cached_tokens = num_cached
        seq.status = SequenceStatus.WAITING_FOR_REMOTE_KV
        load = KVLoad(seq.request_id, source, seq.block_table[first:num_blocks], list(source.block_ids[first:num_blocks]),
                      bm.block_hashes(seq, num_blocks)[first:], first, num_tokens)
        self.loading[seq.request_id] = (seq, load)
        plan.kv_loads.append(load)
        return True

    def remote_load_finished(self, load: KVLoad, ok: bool) -> Sequence | None:
        """A read ended: its request runs from the loaded blocks on (they count as computed and
        enter the prefix cache), or, failed, recomputes its prompt. None: the request ended
        meanwhile (its blocks go back now)."""
        ended = self.reads_ended_after.get(id(load))
        if ended is not None and ended[0] is load:
            del self.reads_ended_after[id(load)]
            self.block_manager.free(ended[1])
            return None
        entry = self.loading.get(load.request_id)
        if entry is None or entry[1] is not load:
            return None
        seq = entry[0]
        del self.loading[load.request_id]
        seq.remote = None
        if ok:
            seq.num_computed_tokens = load.num_tokens
            self.block_manager.cache_full_blocks(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
        else:
            self.block_manager.free(seq)
            seq.status = SequenceStatus.WAITING
            self.waiting.push(seq)
        return seq

    def _free_holds(self) -> None:
        """Blocks a consumer has read, or that waited past their deadline, go back."""
        for seq in self.kv.held.take_freeable(time.monotonic()):
            self.block_manager.free(seq)

    def release_hold(self, engine_id: str, request_id: str) -> bool:
        """Free now (on the step loop's thread, which owns the blocks) what this producer holds
        unread for `request_id`: no consumer will read it. False: nothing held to drop (a read in
        progress frees its hold itself)."""
        if self.kv is None or not self.kv.held.drop(engine_id, request_id):
            return False
        self._free_holds()
        return True

    def _room_from_holds(self) -> bool:
        """With nothing running, blocks held for consumers would stall admission until they
        expire: the oldest hold gives way (its consumer recomputes). True: some were freed."""
        if self.kv is None or self.running or self.loading or not self.kv.held.evict_oldest():
            return False
        self._free_holds()
        return True

    def _lora_slot_free(self, seq: Sequence) -> bool:
        if seq.lora_name is None:
            return True
        running = {s.lora_name for s in self.running if s.lora_name is not None}
        return seq.lora_name in running or len(running) < self.config.max_loras

    def _try_admit(self, seq: Sequence, token_budget: int) -> ScheduledChunk | None:
        if not self._lora_slot_free(seq):
            return None  # waits for a LoRA slot, like a request waiting for blocks
        bm = self.block_manager
        num_cached = 0 if seq.pooling == "mean" else bm.get_computed_prefix(seq)  # mean pools every token
        num_new = self._chunk_tokens(seq.num_tokens - num_cached, token_budget)
        if not bm.can_allocate(seq, num_new, num_cached):
            return None
        self.waiting.pop()
        bm.allocate_slots(seq, num_new, num_cached)
        if seq.status is SequenceStatus.WAITING:  # first admission: record prompt cache hits
            seq.num_cached_tokens = min(seq.num_computed_tokens, seq.num_prompt_tokens)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        return self._make_chunk(seq, num_new)

    def _make_chunk(self, seq: Sequence, num_new: int, num_slots: int = 0) -> ScheduledChunk:
        start = seq.num_computed_tokens
        end = start + num_new
        return ScheduledChunk(
            request_id=seq.request_id,
            token_ids=seq.token_ids(start, end),
            start_pos=start,
            block_table=list(seq.block_table),  # a snapshot: the runner may keep it past update()
            sample=end == seq.num_tokens and seq.pooling is None,
            sampling=seq.sampling,
            prompt_token_ids=seq.prompt_token_ids,
            output_token_ids=seq.output_token_ids,
            num_spec_tokens=num_slots,
            proposer=self.speculation.proposer if num_slots else None,
            pooling=seq.pooling,
            lora_name=seq.lora_name,
        )

    # --- applying the runner's results -----------------------------------------------------

    def update(self, output: SchedulerOutput, runner: RunnerOutput) -> list[StepResult]:
        """Apply one step's results; return what each request produced or how it ended."""
        results = []
        for chunk in output.chunks:
            seq = self.requests.get(chunk.request_id)
            if seq is None or seq.status is not SequenceStatus.RUNNING:
                continue  # aborted or finished between schedule() and update()
            result = self._apply_chunk(seq, chunk, runner)
            if result is not None:
                results.append(result)
        return results

    def _apply_chunk(self, seq: Sequence, chunk: ScheduledChunk, runner: RunnerOutput) -> StepResult | None:
        error = runner.errors.get(seq.request_id)
        if error is not None:  # this request's sampling failed: it ends alone
            return self._fail(seq, error)
        seq.num_computed_tokens = chunk.start_pos + len(chunk.token_ids) + chunk.num_spec_tokens
        if seq.pooling is not None:
            return self._apply_pooling(seq, runner)
        sampled = runner.sampled_token_ids.get(seq.request_id, []) if chunk.sample else []
        drafts = runner.drafts.get(seq.request_id, NO_DRAFTS)
        if chunk.sample and (len(sampled) != 1 + drafts.num_accepted or drafts.num_proposed > chunk.num_spec_tokens):
            # Without its token the request would wait forever for a logit nobody computes.
            raise RuntimeError(f"runner sampled {len(sampled)} tokens for {seq.request_id} ({drafts})")
        if chunk.num_spec_tokens:
            self._keep_accepted(seq, chunk.num_spec_tokens, drafts)
        try:
            new_tokens, reason = self._append_until_stop(seq, sampled)
        except GrammarViolation as exc:
            spec = seq.grammar.spec
            result = self._fail(seq, str(exc), "invalid" if exc.limit else "internal")
            result.failed_grammar = spec
            return result
        self.block_manager.cache_full_blocks(seq)
        if reason is not None:
            self.running.remove(seq)
            self._end(seq, reason)
        if not new_tokens and reason is None:
            return None  # a prefill chunk short of the prompt's end
        logprobs = runner.logprobs.get(seq.request_id)
        return StepResult(
            request_id=seq.request_id,
            new_token_ids=new_tokens,
            finish_reason=reason,
            logprobs=logprobs[: len(new_tokens)] if logprobs is not None else None,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            num_preemptions=seq.num_preemptions,
            spec_decode=self.speculation.request_counts(seq),
            kv_transfer_params=seq.kv_transfer_params,
        )

    def _fail(self, seq: Sequence, error: str, kind: str = "internal") -> StepResult:
        self.running.remove(seq)
        self._end(seq, "abort")
        return StepResult(seq.request_id, [], "abort", num_prompt_tokens=seq.num_prompt_tokens,
                          num_output_tokens=seq.num_output_tokens, error=error, error_kind=kind)

    def _apply_pooling(self, seq: Sequence, runner: RunnerOutput) -> StepResult | None:
        """A pooling request ends on the step that ran its last prompt token: its vector, its KV freed."""
        self.block_manager.cache_full_blocks(seq)  # its prompt's blocks may serve later requests
        if seq.num_computed_tokens < seq.num_tokens:
            return None
        embedding = runner.pooled.get(seq.request_id)
        if embedding is None:  # without it the request would end with nothing to show
            raise RuntimeError(f"runner pooled nothing for {seq.request_id}")
        self.running.remove(seq)
        self._end(seq, "stop")
        return StepResult(seq.request_id, [], "stop", num_prompt_tokens=seq.num_prompt_tokens,
                          num_cached_tokens=seq.num_cached_tokens, num_preemptions=seq.num_preemptions,
                          embedding=embedding)

    def _keep_accepted(self, seq: Sequence, num_slots: int, drafts: DraftCounts) -> None:
        """The slots of drafts not accepted (rejected, or never proposed) are rolled back (blocks
        still needed stay); the accepted ones are the sequence's tokens from now on (their KV is
        already computed)."""
        self.block_manager.rollback(seq, num_slots - drafts.num_accepted)
        self.speculation.record(seq, drafts)

    @staticmethod
    def _append_until_stop(seq: Sequence, sampled: list[int]) -> tuple[list[int], FinishReason | None]:
        """Append sampled tokens one by one; tokens after a stop (speculation) are dropped. A
        constrained request's grammar advances past each (the mask made it allowed)."""
        appended = []
        for token_id in sampled:
            if seq.grammar is not None and not seq.grammar.accept(token_id):
                raise _violation(seq.grammar, token_id)
            seq.output_token_ids.append(token_id)
            appended.append(token_id)
            reason = seq.stop_reason_after(token_id)
            if reason is not None:
                return appended, reason
        return appended, None
