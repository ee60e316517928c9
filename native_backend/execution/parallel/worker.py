"""A parallel worker (ranks 1..N-1 of TP x PP): build this rank's shard of its pipeline stage's
layers, then follow rank 0 step by step.

    start:  load its shard (prefill_matmul / prefill_attention auto: decided from rank 0's probes)
            ──("loaded", blocks it could hold)──> rank 0
            <──("plan", blocks every rank holds, fp8 calibration ids)── rank 0
            join the process group, allocate its KV heads' cache ──("ready", memory report,
            its KV layout)──>
    serve:  <──("step", StepDelta)── rank 0: rebuild the chunks, run the same forward pass (its
            all-reduces and the LM head gather pair with its stage's ranks'; a later pipeline
            stage first receives the previous stage's hidden states, an earlier one sends its
            own on: stage_link); <──("sample", SchedulerOutput)── the last stage's TP rank 0
            under pipeline parallelism: run and sample the step, ──("output", RunnerOutput)──>;
            ("logits", SchedulerOutput, all_tokens): ──("output", logits by request)──> (tests);
            ("busy",): ──("busy", seconds computing since start)──> (bench/pp.py's bubble);
            ("kv_write", block ids) and
            the bytes: a consumer's shard of blocks read from a producer (kv_relay), written
            before the next step; ("stop",): exit
    KV pipe (a producer's): a thread answers rank 0's reads of its shard of held blocks (kv_relay)

Without pipeline parallelism no worker samples or answers per step: rank 0 hears from it only
through the collectives.
An exception is sent to rank 0 as ("error", summary, traceback) and the process exits, which fails
rank 0's next collective at once (gloo: connection closed by peer). The kernel kills it when rank
0's process dies (PR_SET_PDEATHSIG), and EOF on its pipe ends it too.
"""

from __future__ import annotations

import os
import signal
import time
import traceback
from multiprocessing.connection import Connection

import torch

from native_backend.config.engine import EngineConfig
from native_backend.execution.executor import InProcessExecutor
from native_backend.execution.parallel.deltas import ALL_LOGITS, EXECUTE, DeltaDecoder, StepDelta
from native_backend.execution.parallel.group import RENDEZVOUS_HOST, die_with_parent, join_group, rank_device
from native_backend.execution.parallel.kv_relay import start_shard_server, worker_layout, write_shard
from native_backend.execution.parallel.topology import Topology, join_stage_groups, rank_layout, stage_link
from native_backend.model.layers import prefill_attention, prefill_matmul


def run_worker(config: EngineConfig, rank: int, size: int, port: int, conn: Connection,
               kv_conn: Connection | None = None, probes: dict | None = None, num_layers: int = 0,
               store_host: str = RENDEZVOUS_HOST, local_rank: int | None = None) -> None:
    """Entry point of a spawned worker process; `kv_conn`: a producer's KV pipe (kv_relay); `probes`:
    rank 0's start-up probes (executor.start_up_probes), which this rank's `auto` settings follow;
    `num_layers`: the model's decoder layers, which the pipeline stages split; `store_host`: where
    rank 0's store listens (master_addr across nodes); `local_rank`: its index on this machine
    (its GPU; default: the rank, every rank on one machine). `conn` is a pipe from rank 0, or an
    authenticated connection to it from another node (nodes.py)."""
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the group; rank 0 decides
    follow_probes(probes or {})
    code = 0
    try:
        where = (store_host, port, rank if local_rank is None else local_rank)
        executor = _start(config, rank, size, where, conn, kv_conn, num_layers)
        _serve(executor, conn)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # rank 0 went away: nobody is left to follow
    except BaseException as exc:  # noqa: BLE001 - report why, then die so rank 0's collective fails fast
        _send_quietly(conn, ("error", f"{type(exc).__name__}: {exc}", traceback.format_exc()))
        code = 1
    os._exit(code)  # no interpreter teardown: the group's peers may already be gone


def follow_probes(probes: dict) -> None:
    """Decide prefill_matmul's and prefill_attention's `auto` from rank 0's measurements."""
    prefill_matmul.follow(probes.get("prefill_matmul"))
    prefill_attention.follow(probes.get("prefill_attention"))


def _start(config: EngineConfig, rank: int, size: int, where: tuple, conn: Connection, kv_conn: Connection | None,
           num_layers: int):
    store_host, port, local_rank = where
    device = rank_device(config.model.device, local_rank)
    topo = Topology.of(config)
    shard, stage = rank_layout(config, rank, num_layers)
    executor = InProcessExecutor(config, shard, device, allocate=False, stage=stage)
    conn.send(("loaded", executor.plan.num_blocks))
    tag, num_blocks, calibration_ids = conn.recv()
    if tag != "plan":
        raise RuntimeError(f"expected rank 0's plan, got {tag!r}")
    join_group(rank, size, port, device, config.parallel.collective_timeout_s, host=store_host)
    join_stage_groups(topo, shard)
    executor.link = stage_link(topo, rank, executor.model_config.hidden_size, executor.ctx.dtype, device)
    executor.allocate_cache(num_blocks, calibration_ids)
    if kv_conn is not None:
        start_shard_server(executor.kv_cache, kv_conn)
    conn.send(("ready", executor.memory_report(), worker_layout(executor.kv_cache)))
    return executor


def _serve(executor, conn: Connection) -> None:
    decoder, busy = DeltaDecoder(), 0.0
    while True:
        message = conn.recv()
        if message[0] == "stop":
            return
        if message[0] == "kv_write":
            write_shard(executor.kv_cache, conn, message[1])
            continue
        if message[0] == "busy":
            conn.send(("busy", busy))
            continue
        started, waited = time.perf_counter(), _recv_seconds(executor)
        if message[0] == "sample":  # the last pipeline stage's TP rank 0: it samples the step
            conn.send(("output", executor.runner.execute(message[1])))
        elif message[0] == "logits":  # ... or computes its logits (tests, tools)
            with torch.inference_mode():
                conn.send(("output", executor.runner.compute_logits(message[1], all_tokens=message[2])))
        else:
            delta: StepDelta = message[1]
            follow(executor.runner, decoder.decode(delta), delta.mode)
        busy += time.perf_counter() - started - (_recv_seconds(executor) - waited)  # not the wait for a stage


def _recv_seconds(executor) -> float:
    return executor.link.recv_seconds if executor.link is not None else 0.0


@torch.inference_mode()
def follow(runner, scheduled, mode: str) -> None:
    """The forward pass rank 0's ModelRunner runs for this step, without sampling: the same
    collectives in the same order (an all-reduce per row-parallel layer and embedding, one
    LM-head gather when a chunk samples)."""
    if mode != EXECUTE:
        runner.compute_logits(scheduled, all_tokens=mode == ALL_LOGITS)
        return
    if scheduled.is_empty:
        return
    inputs = runner.prepare_inputs(scheduled.chunks)
    hidden = runner.forward(inputs, scheduled.chunks)  # None: a pipeline stage before the last (sent on)
    if hidden is not None and any(c.sample for c in scheduled.chunks):
        runner.model.compute_logits(hidden[inputs.logits_indices])


def _send_quietly(conn: Connection, message: tuple) -> None:
    try:
        conn.send(message)
    except (OSError, EOFError):
        pass
