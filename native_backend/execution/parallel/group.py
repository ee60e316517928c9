"""The tensor-parallel process group: gloo on the CPU, NCCL on CUDA, and a timeout on every
collective (a dead or stopped rank fails the step instead of hanging it: gloo reports a dead peer
at once, a silent one after the timeout).

Every rank runs on this machine, so nothing of the group listens beyond loopback: rank 0's
rendezvous store listens on a socket it bound to 127.0.0.1 itself (torch's store, given a port,
binds every interface) and holds from the moment the port is chosen (a port chosen, released and
bound later could be taken meanwhile); gloo's and NCCL's own connections use the loopback
interface unless GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME say otherwise. Nothing on those ports
authenticates a peer (docs/engine/tensor-parallel.md). An engine across machines (nodes.py) puts the
store on master_addr and gloo/NCCL on the interface towards it, once every rank has proved the secret."""

from __future__ import annotations

import ctypes
import datetime
import os
import signal
import socket

import torch

PR_SET_PDEATHSIG = 1


RENDEZVOUS_HOST = "127.0.0.1"
LOOPBACK_INTERFACE = "lo"  # Linux's name for it, in every network namespace


def open_rendezvous(host: str = RENDEZVOUS_HOST) -> socket.socket:
    """Rank 0's store socket: bound to loopback (across nodes: master_addr's address) on a port the
    kernel picks, and listening from now until the store takes it over (ranks that connect before
    that wait in its backlog)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, 0), family=family, backlog=128)


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def rank_device(device: str, rank: int) -> torch.device:
    """cpu for every rank; cuda (or cuda:k) -> the rank's own GPU, cuda:(k + rank)."""
    base = torch.device(device)
    if base.type != "cuda":
        return base
    return torch.device("cuda", (base.index or 0) + rank)


def join_group(rank: int, size: int, port: int, device: torch.device, timeout_s: float,
               listener: socket.socket | None = None, host: str = RENDEZVOUS_HOST) -> None:
    """Join the group whose store listens on `host` (loopback; master_addr across nodes) `port`;
    rank 0 passes the store's socket (`open_rendezvous()`), which the store takes over."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    if rank == 0:
        store = dist.TCPStore(host, port, size, is_master=True, timeout=timeout, wait_for_workers=False,
                              master_listen_fd=listener.detach())
    else:
        store = dist.TCPStore(host, port, size, is_master=False, timeout=timeout)
    # gloo's own listeners would bind the address the host name resolves to (a pod's IP), NCCL's
    # bootstrap the first non-loopback interface: keep both on loopback unless told otherwise
    os.environ.setdefault("GLOO_SOCKET_IFNAME", LOOPBACK_INTERFACE)
    os.environ.setdefault("NCCL_SOCKET_IFNAME", LOOPBACK_INTERFACE)
    kwargs = {}
    if device.type == "cuda":
        torch.cuda.set_device(device)
        kwargs["device_id"] = device  # NCCL: bind the communicator to this rank's GPU now
    dist.init_process_group(backend_for(device), store=store, rank=rank, world_size=size, timeout=timeout, **kwargs)


def leave_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def die_with_parent() -> None:
    """Linux: the kernel SIGKILLs this process when the process that spawned it dies, however it
    dies (SIGKILL included), so no worker outlives its engine."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: the pipe's EOF still ends the worker's loop
