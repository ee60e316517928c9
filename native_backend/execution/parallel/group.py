"""The tensor-parallel process group: gloo on the CPU, NCCL on CUDA, rendezvous on a free
loopback port, and a timeout on every collective (a dead or stopped rank fails the step instead
of hanging it: gloo reports a dead peer at once, a silent one after the timeout)."""

from __future__ import annotations

import ctypes
import datetime
import signal
import socket

import torch

PR_SET_PDEATHSIG = 1


def free_loopback_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def rank_device(device: str, rank: int) -> torch.device:
    """cpu for every rank; cuda (or cuda:k) -> the rank's own GPU, cuda:(k + rank)."""
    base = torch.device(device)
    if base.type != "cuda":
        return base
    return torch.device("cuda", (base.index or 0) + rank)


def join_group(rank: int, size: int, port: int, device: torch.device, timeout_s: float) -> None:
    import torch.distributed as dist

    kwargs = {}
    if device.type == "cuda":
        torch.cuda.set_device(device)
        kwargs["device_id"] = device  # NCCL: bind the communicator to this rank's GPU now
    dist.init_process_group(backend_for(device), init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size, timeout=datetime.timedelta(seconds=timeout_s), **kwargs)


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
