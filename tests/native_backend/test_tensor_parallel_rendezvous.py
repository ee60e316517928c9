"""The tensor-parallel group keeps to loopback: rank 0's rendezvous port is held (bound to
127.0.0.1 and listening) from the moment it is chosen until the store takes it over, so no other
process can take it in between, and a running TP group (rank 0 and its workers, on the tiny
random Llama) listens on loopback addresses only: the store, which torch binds to every
interface when given a port, and gloo's own connections, which it would otherwise bind to the
address the host name resolves to."""

from __future__ import annotations

import errno
import ipaddress
import os
import socket

import psutil
import pytest
import torch

from native_backend.execution.parallel.group import open_rendezvous
from tests.support.checks.tensor_parallel_checks import executor_for, tiny_gqa_llama

pytestmark = pytest.mark.timeout(600)


def test_the_rendezvous_port_is_held_on_loopback_from_the_moment_it_is_chosen():
    with open_rendezvous() as listener:
        host, port = listener.getsockname()
        assert host == "127.0.0.1"
        for address in ("127.0.0.1", "0.0.0.0"):  # neither here nor on every interface
            with socket.socket() as other, pytest.raises(OSError) as taken:
                other.bind((address, port))
            assert taken.value.errno == errno.EADDRINUSE
        with socket.create_connection((host, port), timeout=5):
            pass  # a rank that connects before the store starts waits in the backlog


def listening_addresses(pid: int) -> list[str]:
    return [c.laddr.ip for c in psutil.Process(pid).net_connections("inet") if c.status == psutil.CONN_LISTEN]


def test_a_running_group_listens_on_loopback_only(tmp_path):
    torch.set_num_threads(1)
    executor = executor_for(tiny_gqa_llama(tmp_path / "tiny-gqa"), 2)
    try:
        ranks = {"rank 0": os.getpid(), **{f"rank {w.rank}": w.process.pid for w in executor.workers}}
        listening = {rank: listening_addresses(pid) for rank, pid in ranks.items()}
    finally:
        executor.close()
    assert listening["rank 0"], listening  # the store, at least
    exposed = {rank: [a for a in addresses if not ipaddress.ip_address(a).is_loopback]
               for rank, addresses in listening.items()}
    assert not any(exposed.values()), f"listening beyond loopback: {exposed}"
