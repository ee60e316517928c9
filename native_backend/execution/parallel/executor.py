"""Rank 0's side of tensor and pipeline parallelism: start the workers, step them, watch them, stop them.

    TensorParallelExecutor(config)
      check      the model splits across N (else the valid sizes; packed int4 linears, AWQ or
                 GGUF Q4, in whole int32 words and groups); speculative decoding with N > 1:
                 method ngram (every rank runs the verification), draft refused with the reason
      spawn      ranks 1..N-1 (spawn context, daemonic, killed with this process)
      probe      the start-up probes of `prefill_matmul: auto` and `prefill_attention: auto`, once,
                 here; the workers decide from their results
      load       rank 0's shard here while the workers load theirs
      agree      KV blocks = the smallest any rank can hold; fp8 calibration ids from rank 0
      join       the process group (gloo / NCCL, loopback port, collective timeout)
      execute    rank 0's proposer fills the step's draft slots; then the step's delta (drafts
                 included) goes to every worker, and rank 0's ModelRunner runs it (it samples)
      KV relay   with a kv_role: kv_blocks() gives the KV connector every rank's blocks (kv_relay:
                 a producer's workers answer shard reads on a KV pipe of their own; a consumer's
                 shards go to the workers on the step pipe, ahead of the next step)
      pipeline   with pipeline_parallel_size P > 1 (TP x P ranks, parallel.topology): rank 0 runs
                 stage 0 and sends its hidden states on (stage_link); the last stage's TP rank 0
                 gets the whole step ("sample") and sends the RunnerOutput back on its pipe.
                 `submit` starts a step and returns once stage 0 is done with it, `collect` takes
                 the oldest step's output: the engine core keeps up to P steps in flight
                 (max_concurrent_batches), so stage 0 runs the next batch while later stages
                 finish the previous ones
      faults     a worker that died or stopped fails the step (TensorParallelError naming the
                 rank and why), so the engine process reports a fatal error and exits; its
                 supervisor restarts it. An idle engine notices through check_health().
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import multiprocessing.util
import dataclasses
import re
import signal
import time
from dataclasses import dataclass

import torch

from native_backend.config.engine import EngineConfig
from native_backend.core.batch import RunnerOutput, SchedulerOutput
from native_backend.execution.executor import InProcessExecutor
from native_backend.execution.parallel.deltas import ALL_LOGITS, EXECUTE, LOGITS, DeltaEncoder
from native_backend.execution.parallel.group import (
    RENDEZVOUS_HOST, backend_for, join_group, leave_group, open_rendezvous, rank_device)
from native_backend.execution.parallel.nodes import NodeListener, RemoteRank, load_secret, use_interface_towards
from native_backend.execution.parallel.kv_relay import ShardPipe, TensorParallelBlocks
from native_backend.execution.parallel.report import describe_rank
from native_backend.execution.parallel.topology import Topology, join_stage_groups, rank_layout, stage_link
from native_backend.execution.parallel.validate import check_model_on_disk, check_pipeline, check_speculative_method
from native_backend.execution.parallel.worker import run_worker
from native_backend.model.layers import prefill_attention, prefill_matmul
from native_backend.model.layers.sharding import CommStats
from native_backend.model.loader import read_model_config

log = logging.getLogger("kvgate.engine")

START_TIMEOUT_S = 600.0  # a worker loading its shard: the engine client's own start-up timeout is the real bound
STOP_TIMEOUT_S = 5.0  # a worker that has not exited this long after "stop" is killed
FAULT_POLL_S = 1.0  # waiting for the last pipeline stage's output: how often to look for a stopped rank


STOPPED, DIED, LOST_PEER, TIMED_OUT = "stopped", "died", "lost a peer", "timed out"  # what a worker's state says


class TensorParallelError(RuntimeError):
    """The tensor-parallel group cannot run a step: a worker died, stopped, or failed."""


@dataclass
class _Worker:
    rank: int
    process: multiprocessing.process.BaseProcess
    conn: multiprocessing.connection.Connection
    kv_conn: multiprocessing.connection.Connection | None = None  # a producer's KV pipe (kv_relay)
    error: str | None = None  # what it reported before exiting


class TensorParallelExecutor:
    def __init__(self, config: EngineConfig, tokenizer=None):
        self.config = config
        self.tokenizer = tokenizer  # rank 0's calibration text (text.tokenizer.Tokenizer; None: loaded then)
        self.topo = Topology.of(config)
        self.size = self.topo.world  # ranks in all
        self.max_concurrent_batches = self.topo.pp  # steps in flight: one per stage
        self._kind = "tensor-parallel" if self.topo.pp == 1 else "pipeline-parallel"
        self._in_flight = 0  # steps submitted and not collected
        self._busy = 0.0  # rank 0's seconds computing steps (stage_busy_seconds)
        check_supported(config)
        self.comm = CommStats()
        self.device = rank_device(config.model.device, 0)
        self.workers: list[_Worker] = []
        self._closed = False
        # At exit, before multiprocessing's own handler, which would SIGTERM the daemonic workers and
        # join them: forever, for a stopped one (the engine process is itself a multiprocessing
        # child, where that handler runs before atexit's).
        multiprocessing.util.Finalize(self, self.close, exitpriority=10)
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        self.encoder = DeltaEncoder()
        self.model_config = self.rank.model_config
        self.max_model_len = self.rank.max_model_len
        self.plan = self.rank.plan
        self.weights = self.rank.weights  # the decoder linears' format, as every rank has it
        self.kernel_path = self.rank.kernel_path
        self.prefill_path = self.rank.prefill_path  # every rank follows rank 0's probes

    def _start(self) -> None:
        par = self.config.parallel
        if par.nnodes == 1:
            with open_rendezvous() as listener:  # closed if the start fails before the store takes it over
                self._start_group(listener, RENDEZVOUS_HOST, None)
            return
        nodes = NodeListener(par.master_addr, par.master_port, load_secret(par.rendezvous_secret_file), self.size,
                             par.nnodes)
        try:
            use_interface_towards(nodes.address)  # before the local workers start: they inherit it
            with open_rendezvous(nodes.address) as listener:
                self._start_group(listener, nodes.address, nodes)
        finally:
            nodes.close()  # every rank has joined (or the start failed): nothing more to accept

    def _start_group(self, listener, store_host: str, nodes: NodeListener | None) -> None:
        port, ctx = listener.getsockname()[1], multiprocessing.get_context("spawn")
        probes = start_up_probes(self.config)  # before the workers start: nothing of ours loads the cores yet
        num_layers = read_model_config(self.config.model.path).num_layers
        for rank in range(1, self.size // self.config.parallel.nnodes):  # this node's; the others' join below
            ours, theirs = ctx.Pipe(duplex=True)
            kv_ours, kv_theirs = ctx.Pipe(duplex=True) if self.config.transfer.produces else (None, None)
            process = ctx.Process(target=run_worker,
                                  args=(self.config, rank, self.size, port, theirs, kv_theirs, probes, num_layers,
                                        store_host),
                                  name=f"kvgate-tp-rank{rank}", daemon=True)
            process.start()
            theirs.close()
            if kv_theirs is not None:
                kv_theirs.close()
            self.workers.append(_Worker(rank, process, ours, kv_ours))
        if nodes is not None:
            self._join_nodes(nodes, (store_host, port, probes, num_layers))
        shard, stage = rank_layout(self.config, 0, num_layers, self.comm)
        self.rank = InProcessExecutor(self.config, shard, self.device, allocate=False, tokenizer=self.tokenizer,
                                      stage=stage)
        blocks = [self.rank.plan.num_blocks, *(m[1] for m in self._hear_from_all("loaded"))]
        ids = self.rank.calibration_ids() if self.rank.needs_calibration else None
        self._send_all(("plan", min(blocks), ids))
        join_group(0, self.size, port, self.device, self.config.parallel.collective_timeout_s, listener, store_host)
        join_stage_groups(self.topo, shard)
        self.rank.link = stage_link(self.topo, 0, self.rank.model_config.hidden_size, self.rank.ctx.dtype, self.device)
        self.rank.allocate_cache(min(blocks), ids)
        ready = self._hear_from_all("ready")
        self.reports = [dict(r, rank=i) for i, r in enumerate([self.rank.memory_report(), *(m[1] for m in ready)])]
        self.worker_kv_layouts = [m[2] for m in ready]  # kv_relay: each worker's KV layout and block bytes

    def _join_nodes(self, nodes: NodeListener, start: tuple) -> None:
        """Wait for the other nodes' ranks (nodes.py: authenticated), then start each as rank 0
        starts its own workers; their connections serve as their pipes."""
        per_node = self.size // self.config.parallel.nnodes
        for rank, joined in sorted(nodes.wait_for_ranks(START_TIMEOUT_S).items()):
            joined.conn.send(("start", self.config, self.size, *start))
            self.workers.append(_Worker(rank, RemoteRank(joined.conn, rank // per_node, joined.peer), joined.conn))

    @property
    def _remote(self) -> bool:
        return self.config.parallel.nnodes > 1

    # ------------------------------------------------------------------ steps

    def execute(self, scheduled: SchedulerOutput) -> RunnerOutput:
        if self.topo.pp > 1:
            self.submit(scheduled)
            return self.collect()
        scheduled, draft_probs = self.rank.propose(scheduled)  # before the deltas: workers run the drafts too
        self._step_workers(scheduled, EXECUTE)
        try:
            return self.rank.runner.execute(scheduled, draft_probs)
        except RuntimeError as exc:  # gloo/NCCL: a peer closed its connection, or the timeout
            raise self._fault(exc) from None

    # ------------------------------------------------------------------ pipeline steps

    def submit(self, scheduled: SchedulerOutput) -> None:
        """Start a step (pipeline parallelism): every worker gets it, rank 0 runs stage 0 and sends
        its hidden states on; the output comes from `collect`, oldest step first."""
        scheduled, _ = self.rank.propose(scheduled)  # n-gram drafts (a draft model is refused under PP)
        scheduled = dataclasses.replace(scheduled, kv_loads=[])  # the engine's, never the workers'
        self._step_workers(scheduled, EXECUTE)
        started = time.perf_counter()
        try:
            self.rank.runner.execute(scheduled)
        except RuntimeError as exc:
            raise self._fault(exc) from None
        self._busy += time.perf_counter() - started
        self._in_flight += 1

    def collect(self) -> RunnerOutput:
        """The oldest step's output, from the last stage; a worker that died, failed or stopped
        meanwhile raises TensorParallelError naming it."""
        self._in_flight -= 1
        return self._await_sampler()

    def _await_sampler(self):
        worker = self.workers[self.topo.sampler_rank - 1]
        sentinels = [w.process.sentinel for w in self.workers]
        # a stopped rank on another node shows in no /proc here: its silence is bounded instead
        deadline = time.monotonic() + self.config.parallel.collective_timeout_s if self._remote else None
        while True:
            if deadline is not None and time.monotonic() > deadline:
                raise self._silent(worker)
            ready = multiprocessing.connection.wait(_distinct(worker.conn, *sentinels), FAULT_POLL_S)
            if worker.conn in ready:
                try:
                    message = worker.conn.recv()
                except (EOFError, OSError) as exc:
                    raise self._fault(exc) from None
                if message[0] == "output":
                    return message[1]
                self._note_error(worker, message)
                raise self._fault(RuntimeError(message[1]))
            if ready or any(_is_stopped(w.process.pid) for w in self.workers):
                # a sentinel fires as the process closes its files, a moment before it can be reaped
                raise self._fault(None, wait=True)

    @property
    def in_flight(self) -> int:
        """Steps submitted whose output has not been collected."""
        return self._in_flight

    def stage_busy_seconds(self) -> list[float]:
        """Seconds each stage's TP rank 0 has spent computing steps since start, not waiting for
        the previous stage (bench/pp.py: the bubble is what is left of stages x wall time).
        Only between steps (nothing in flight)."""
        if self._in_flight:
            raise RuntimeError("stage_busy_seconds with steps in flight")
        seconds = [self._busy]
        for stage in range(1, self.topo.pp):
            worker = self.workers[stage * self.topo.tp - 1]
            worker.conn.send(("busy",))
            seconds.append(worker.conn.recv()[1])
        return seconds

    def count_drafts(self, request_id: str, tokens: list[int], k: int) -> int:
        return self.rank.count_drafts(request_id, tokens, k)  # rank 0's proposer fills the slots

    def compute_logits(self, scheduled: SchedulerOutput, all_tokens: bool = False) -> dict[str, torch.Tensor]:
        """ModelRunner.compute_logits on every rank (tests): the whole vocabulary's logits (under
        pipeline parallelism from the last stage, which sends them back)."""
        self._step_workers(scheduled, ALL_LOGITS if all_tokens else LOGITS)
        try:
            logits = self.rank.compute_logits(scheduled, all_tokens)
        except RuntimeError as exc:
            raise self._fault(exc) from None
        return self._await_sampler() if self.topo.pp > 1 else logits

    def _step_workers(self, scheduled: SchedulerOutput, mode: str) -> None:
        """The step's delta to every worker; under pipeline parallelism the last stage's TP rank 0
        gets the whole step instead (it samples: settings, histories, grammar masks)."""
        delta = self.encoder.encode(scheduled, mode)
        sampler = self.topo.sampler_rank if self.topo.pp > 1 else None
        if sampler is None and not delta.chunks and not delta.dropped:
            return  # nothing runs and nothing to forget
        try:
            for worker in self.workers:
                if worker.rank != sampler:
                    worker.conn.send(("step", delta))
                elif mode == EXECUTE:
                    worker.conn.send(("sample", scheduled))
                else:
                    worker.conn.send(("logits", scheduled, mode == ALL_LOGITS))
        except OSError as exc:
            raise self._fault(exc) from None

    def kv_clamped(self) -> tuple[int, int]:
        """Rank 0's count over its share of the KV heads (the ranks' scales are alike: every rank
        takes each layer's largest, so a clamp on one rank's heads is as likely as on another's)."""
        return self.rank.kv_clamped()

    # ------------------------------------------------------------------ prefill/decode disaggregation

    def kv_blocks(self) -> TensorParallelBlocks:
        """Every rank's KV blocks, for the KV connector (process.factory, with a kv_role)."""
        pipes = [ShardPipe(w.rank, w.kv_conn, layout["block_bytes"])
                 for w, layout in zip(self.workers, self.worker_kv_layouts) if w.kv_conn is not None]
        return TensorParallelBlocks(self.rank.kv_cache, pipes, self.worker_kv_layouts, self._send_kv_shard)

    def _send_kv_shard(self, rank: int, block_ids: list[int], payload: memoryview) -> None:
        """A consumer's commit (the step loop's thread, between steps): the worker writes its
        shard before it reads the next step. OSError: the worker is gone (that read recomputes)."""
        worker = self.workers[rank - 1]
        worker.conn.send(("kv_write", block_ids))
        worker.conn.send_bytes(payload)

    # ------------------------------------------------------------------ health

    def check_health(self) -> None:
        """Raises TensorParallelError when a worker is gone (the engine calls this while idle too)."""
        for worker in self.workers:
            if not worker.process.is_alive():
                raise self._fault(None)

    def _fault(self, cause: BaseException | None, wait: bool | None = None) -> TensorParallelError:
        """Why the group failed, naming the rank: a stopped rank (the collective timed out on it),
        else a rank that died (its own report, or the signal that killed it). Ranks that only
        lost a peer or gave up waiting on a silent one are consequences, named only when nothing
        else explains the failure. `wait`: give ranks that are exiting a moment to be reaped
        (default: when a collective failed)."""
        found = {STOPPED: [], DIED: [], LOST_PEER: [], TIMED_OUT: []}
        for worker in self.workers:
            kind, text = self._diagnose(worker, wait=cause is not None if wait is None else wait)
            if kind is not None:
                found[kind].append(f"rank {worker.rank} {text}" if text.startswith("on node") else
                                   f"rank {worker.rank}{_node_of(worker)} {text}")
        timeout = f"a rank did not answer within {self.config.parallel.collective_timeout_s:g} s (collective timeout)"
        if found[STOPPED]:
            message = f"{self._kind} step failed: {timeout}: {'; '.join(found[STOPPED])}"
        elif found[DIED] or found[LOST_PEER]:
            message = f"{self._kind} worker died: {'; '.join(found[DIED] or found[LOST_PEER])}"
        elif found[TIMED_OUT] or (cause is not None and _is_timeout(str(cause))):
            message = f"{self._kind} step failed: {timeout}: a rank stopped or hung"
        else:
            message = f"{self._kind} collective failed: {_without_source_path(str(cause))}"
        log.error("%s", message)
        return TensorParallelError(message)

    def _silent(self, worker: _Worker) -> TensorParallelError:
        message = (f"{self._kind} step failed: no output within {self.config.parallel.collective_timeout_s:g} s "
                   f"(collective timeout) from the last stage (rank {worker.rank}{_node_of(worker)}): a rank "
                   "on another node stopped or hung")
        log.error("%s", message)
        return TensorParallelError(message)

    def _diagnose(self, worker: _Worker, wait: bool) -> tuple[str | None, str]:
        worker.process.join(0.5 if wait else 0)  # a rank that just died: let it be reaped
        self._read_error(worker)
        if _is_stopped(worker.process.pid):
            return STOPPED, "is stopped (SIGSTOP?)"
        if worker.process.is_alive():
            return None, ""
        if worker.error and _is_timeout(worker.error):
            return TIMED_OUT, "gave up waiting"
        if worker.error and _is_lost_peer(worker.error):
            return LOST_PEER, "lost its connection to a peer"
        return DIED, worker.error or _exit_text(worker.process)

    @staticmethod
    def _read_error(worker: _Worker) -> None:
        try:
            while worker.conn.poll(0):
                TensorParallelExecutor._note_error(worker, worker.conn.recv())
        except (OSError, EOFError):
            pass

    @staticmethod
    def _note_error(worker: _Worker, message: tuple) -> None:
        if message[0] == "error":
            worker.error = f"failed: {_without_source_path(message[1])}"
            log.error("parallel rank %d: %s", worker.rank, message[2])

    # ------------------------------------------------------------------ start-up and shutdown

    def _send_all(self, message: tuple) -> None:
        for worker in self.workers:
            worker.conn.send(message)

    def _hear_from_all(self, tag: str) -> list[tuple]:
        """Each worker's next message, which must be `tag`; a worker's failure or death raises."""
        timeout = START_TIMEOUT_S
        messages = []
        for worker in self.workers:
            ready = multiprocessing.connection.wait(_distinct(worker.conn, worker.process.sentinel), timeout)
            if worker.conn in ready:
                try:
                    message = worker.conn.recv()
                except EOFError:
                    message = ("error", _exit_text(worker.process), "")
            elif ready:
                worker.process.join(1.0)
                message = ("error", _exit_text(worker.process), "")
            else:
                message = ("error", f"sent nothing within {timeout:g} s", "")
            if message[0] != tag:
                if message[2]:
                    log.error("tensor-parallel rank %d:\n%s", worker.rank, message[2])
                raise TensorParallelError(f"{self._kind} rank {worker.rank} failed to start: {message[1]}")
            messages.append(message)
        return messages

    def close(self) -> None:
        """Stop every worker (kill what does not exit) and leave the group; idempotent."""
        if self._closed:
            return
        self._closed = True
        for worker in self.workers:
            try:
                worker.conn.send(("stop",))
            except (OSError, ValueError):
                pass
        for worker in self.workers:
            if not _is_stopped(worker.process.pid):
                worker.process.join(STOP_TIMEOUT_S)
            if worker.process.is_alive():  # hung, or stopped (a stopped process acts on SIGKILL alone)
                worker.process.kill()
                worker.process.join(STOP_TIMEOUT_S)
            worker.conn.close()
            if isinstance(worker.process, RemoteRank):
                worker.process.close()
            if worker.kv_conn is not None:
                worker.kv_conn.close()
        leave_group()

    # ------------------------------------------------------------------ reports

    def describe(self) -> str:
        mc, p = self.config.model, self.plan
        ranks = "; ".join(describe_rank(r, pipeline=self.topo.pp > 1) for r in self.reports)
        layout = f"{self.size} tensor-parallel ranks" if self.topo.pp == 1 else (
            f"{self.size} ranks (tensor parallel {self.topo.tp} x pipeline parallel {self.topo.pp} stages of "
            f"{', '.join(str(r['num_layers']) for r in self.reports[::self.topo.tp])} layers, "
            f"up to {self.topo.pp} steps in flight)")
        par = self.config.parallel
        where = f"{par.nnodes} nodes from {par.master_addr}" if self._remote else "loopback"
        return (f"{mc.path} on {layout} ({backend_for(self.device)} over {where}, "
                f"{mc.device}, {mc.dtype}, {self.rank.model.ctx.kernels}; decode steps per layer: the one-call "
                f"decode step is single-rank only); KV cache {self.rank.kv_dtype.name} "
                f"{p.num_blocks} blocks x {p.block_size} tokens on every rank, {p.full_context_sequences} "
                f"sequences at full context {p.max_model_len}; per rank: {ranks}")

    @property
    def collective_seconds(self) -> float:
        """Rank 0's time inside all-reduces and gathers since start (bench/tp.py)."""
        return self.comm.seconds


def start_up_probes(config: EngineConfig) -> dict | None:
    """Rank 0's start-up probes for the workers to decide from (worker.follow_probes):
    `prefill_matmul: auto`'s (the CPU's bf16 unit, bf16's measured speed-up) and
    `prefill_attention: auto`'s (the bf16 kernel's speed-up, None where it cannot run). Probing on
    their own, each while the others load, ranks of one engine could choose differently and
    round their partial sums differently. None: nothing to probe (explicit settings, a GPU, a
    model that is not float32)."""
    mc = config.model
    if rank_device(mc.device, 0).type != "cpu" or mc.dtype != "float32":
        return None
    probes = {}
    if mc.prefill_matmul == "auto":
        probes["prefill_matmul"] = prefill_matmul.auto_probe()
    if mc.prefill_attention == "auto":
        probes["prefill_attention"] = prefill_attention.auto_probe()
    return probes or None


def check_supported(config: EngineConfig) -> None:
    """Refuse at start what tensor and pipeline parallelism do not run yet, and sizes the model
    cannot split."""
    size = config.parallel.tensor_parallel_size
    check_speculative_method(size, config.speculative.method if config.speculative else None,
                             config.parallel.pipeline_parallel_size)
    check_model_on_disk(config.model.path, size, config.model.quantization)
    if config.parallel.pipeline_parallel_size > 1:
        check_pipeline(config, read_model_config(config.model.path).num_layers)
    if config.parallel.nnodes > 1 and config.transfer.kv_role is not None:
        raise ValueError(f"parallel.nnodes {config.parallel.nnodes} with kv_role '{config.transfer.kv_role}': not "
                         "supported yet (a producer's other nodes would serve their shards of its blocks)")


def _without_source_path(text: str) -> str:
    """gloo puts "[/path/to/gloo/file.cc:NN] " in its errors: clients see no paths."""
    return re.sub(r"\[/[^\]]*\] ", "", text)


def _is_timeout(text: str) -> bool:
    return "timed out" in text.lower()


def _is_lost_peer(text: str) -> bool:
    """gloo's words for a peer that went away: a consequence of another rank's death."""
    return any(w in text for w in ("Connection closed by peer", "Connection reset by peer", "Read error"))


def _is_stopped(pid: int | None) -> bool:
    """Linux: the process is in state T (stopped by a signal) or t (traced)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def _distinct(*waitables) -> list:
    """Each once: a remote rank's sentinel is its connection (wait() refuses an object twice)."""
    return list({id(w): w for w in waitables}.values())


def _exit_text(process) -> str:
    """How a rank ended: a local process's exit code or signal, a remote rank's closed connection."""
    return process.describe_exit() if isinstance(process, RemoteRank) else _describe_exit(process.exitcode)


def _node_of(worker: _Worker) -> str:
    return f" on node {worker.process.node}" if isinstance(worker.process, RemoteRank) else ""


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "is not answering"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"
