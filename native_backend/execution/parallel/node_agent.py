"""A headless node of an engine that spans machines (`kvgate engine --headless --node-rank n`): it
holds its ranks and serves no HTTP.

    loop:  connect to rank 0's rendezvous (nodes.py), prove the secret, ask for node n's ranks
           (retrying while no engine listens: it may be starting, or restarting)
           spawn one process per rank (local rank k: cuda:k on a GPU node); each connects and
           authenticates on its own, gets the engine's config, loads its shard and follows rank 0
           (worker.run_worker) until the engine stops or fails
           when any of them exits, stop the others: the engine fails as a whole, its supervisor
           restarts it on node 0, and this node joins the new one
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import time

from native_backend.execution.parallel.nodes import RendezvousError, connect, use_interface_towards

log = logging.getLogger("kvgate.engine")

RETRY_S = 1.0  # between attempts to reach rank 0
STOP_TIMEOUT_S = 5.0


def run_node(host: str, port: int, node: int, secret: bytes, rounds: int | None = None) -> int:
    """Serve as node `node` until killed (or for `rounds` engines: tests). Returns an exit code."""
    ctx = multiprocessing.get_context("spawn")
    served, last_problem = 0, None
    while rounds is None or served < rounds:
        try:
            conn, answer = connect(host, port, secret, ("node", node))
        except (OSError, RendezvousError) as exc:
            if str(exc) != last_problem:  # once per kind of problem, not every second
                log.warning("node %d: cannot join the engine at %s:%d yet: %s", node, host, port, exc)
                last_problem = str(exc)
            time.sleep(RETRY_S)
            continue
        conn.close()
        last_problem = None
        ranks = answer[1]
        log.info("node %d: joining the engine at %s:%d with ranks %s of %d", node, host, port, ranks, answer[2])
        processes = [ctx.Process(target=run_remote_rank, args=(host, port, secret, node, rank, local),
                                 name=f"kvgate-node{node}-rank{rank}", daemon=True)
                     for local, rank in enumerate(ranks)]
        for p in processes:
            p.start()
        _wait_for_any(processes)
        served += 1
    return 0


def _wait_for_any(processes: list) -> None:
    """Until one of this node's ranks exits; then the others are stopped (the group is broken)."""
    multiprocessing.connection.wait([p.sentinel for p in processes])
    for p in processes:
        p.join(0.5)
        if p.exitcode not in (None, 0):
            log.warning("%s exited (code %s): the engine's group is broken", p.name, p.exitcode)
    for p in processes:
        if p.is_alive():
            p.terminate()
            p.join(STOP_TIMEOUT_S)
        if p.is_alive():
            p.kill()
            p.join()


def run_remote_rank(host: str, port: int, secret: bytes, node: int, rank: int, local_rank: int) -> None:
    """A rank's process on a headless node: authenticate as `rank`, take rank 0's start message,
    then serve exactly as a worker rank 0 spawned itself."""
    from native_backend.execution.parallel.worker import run_worker

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        conn, _ = connect(host, port, secret, ("rank", rank))
        start = conn.recv()
    except (OSError, EOFError, RendezvousError) as exc:
        log.error("node %d rank %d: %s", node, rank, exc)
        raise SystemExit(1) from None
    if start[0] != "start":
        raise SystemExit(f"node {node} rank {rank}: expected rank 0's start, got {start[0]!r}")
    # the store at the address this node dialed (it reached rank 0 there), not the one rank 0 bound
    _, config, world, _, store_port, probes, num_layers = start
    local_address = conn_local_address(conn)
    use_interface_towards(local_address)
    run_worker(config, rank, world, store_port, conn, None, probes, num_layers, store_host=host,
               local_rank=local_rank)


def conn_local_address(conn) -> str:
    """This node's address on the connection to rank 0 (the interface gloo/NCCL should use)."""
    sock = socket.socket(fileno=os.dup(conn.fileno()))
    try:
        return sock.getsockname()[0]
    finally:
        sock.close()
