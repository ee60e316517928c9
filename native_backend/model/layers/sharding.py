"""Which part of a tensor this rank holds, and how a checkpoint tensor becomes that part.

    a dimension of n split across size ranks:   rank r holds [r * n/size, (r+1) * n/size)

    n = 12, size = 3:   rank 0 [0..4)   rank 1 [4..8)   rank 2 [8..12)

One rank of one (size 1) is the whole tensor: the single-device engine is the degenerate case of
tensor parallelism, not a separate code path.

KV heads (grouped-query attention) split like any dimension while there are at least as many as
ranks; with fewer, each KV head is replicated on the ranks whose query heads read it:

    8 query heads, 2 KV heads, 4 ranks:   rank   0    1    2    3
                                          q      0-1  2-3  4-5  6-7
                                          kv     0    0    1    1     (kv_head_shard: rank r // 2 of 2)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import nn


class CommStats:
    """Time spent in this rank's collectives (host wall clock; on CUDA the launch, not the transfer)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0
        self.bytes = 0

    def add(self, started: float, tensor: torch.Tensor) -> None:
        self.seconds += time.perf_counter() - started
        self.calls += 1
        self.bytes += tensor.numel() * tensor.element_size()


class GroupHandle:
    """The torch.distributed group a shard's collectives run in, known once the ranks have joined
    (a layer is built before that): under pipeline parallelism each stage's tensor-parallel ranks;
    `pg` None: the default group (tensor parallelism alone: every rank)."""

    def __init__(self, ranks: tuple[int, ...]) -> None:
        self.ranks = tuple(ranks)  # global ranks, the first one gathers the LM head's slices
        self.pg = None


@dataclass(frozen=True)
class ShardSpec:
    rank: int = 0
    size: int = 1
    # this rank's collective counters (tensor-parallel ranks only); not part of the spec's identity
    comm: CommStats | None = field(default=None, compare=False, repr=False)
    group: GroupHandle | None = field(default=None, compare=False, repr=False)  # None: the default group

    def __post_init__(self):
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"shard {self.rank} of {self.size}: rank must be in [0, size)")

    def part(self, n: int, what: str) -> int:
        """This rank's share of a dimension of n; refuses a dimension that does not split evenly."""
        if n % self.size:
            raise ValueError(f"{what}: {n} cannot be split across {self.size} ranks")
        return n // self.size

    def narrow(self, full: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's slice of a whole checkpoint tensor along `dim` (a view, no copy)."""
        if self.size == 1:
            return full
        n = self.part(full.shape[dim], f"dimension {dim} of a {tuple(full.shape)} tensor")
        return full.narrow(dim, self.rank * n, n)

    def kv_head_shard(self, num_kv_heads: int) -> ShardSpec:
        """The split of the KV heads (k/v projections, this rank's KV cache): this spec while the
        heads split evenly; with fewer heads than ranks, rank r holds head r // (size / heads)
        whole (replicated), so the spec is `rank // replicas` of `num_kv_heads`. Its `narrow` and
        `part` are what a column-parallel k/v projection needs; it never runs a collective."""
        if num_kv_heads >= self.size:
            return self
        if self.size % num_kv_heads:
            raise ValueError(f"KV heads: {num_kv_heads} cannot be split or replicated across {self.size} ranks")
        replicas = self.size // num_kv_heads
        return ShardSpec(self.rank // replicas, num_kv_heads)

    def all_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """Sum of every rank's partial result (the tensor-parallel group's collective)."""
        if self.size == 1:
            return partial
        import torch.distributed as dist

        started = time.perf_counter()
        dist.all_reduce(partial, group=self._process_group())
        if self.comm is not None:
            self.comm.add(started, partial)
        return partial

    def gather_last_dim(self, part: torch.Tensor) -> torch.Tensor | None:
        """Every rank's `part` concatenated along the last dimension, on rank 0 (the LM head's
        vocabulary slices, for sampling there); None on the other ranks."""
        if self.size == 1:
            return part
        import torch.distributed as dist

        started = time.perf_counter()
        part = part.contiguous()
        parts = [torch.empty_like(part) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(part, parts, group=self._process_group(), group_dst=0)
        if self.comm is not None:
            self.comm.add(started, part)
        return torch.cat(parts, dim=-1) if parts is not None else None

    def _process_group(self):
        return self.group.pg if self.group is not None else None


SINGLE = ShardSpec()


class LazyTensor:
    """A checkpoint tensor not read yet: its shape, a narrower one (`narrow`, what ShardSpec.narrow
    calls), and its values (`read`). The loader hands these to tensor-parallel ranks, so that a
    weight loader narrows first and a rank reads only its slice from the file."""

    shape: tuple[int, ...]

    def dim(self) -> int:
        return len(self.shape)

    def narrow(self, dim: int, start: int, length: int) -> LazyTensor:
        raise NotImplementedError

    def read(self) -> torch.Tensor:
        raise NotImplementedError


def materialize(loaded: torch.Tensor | LazyTensor) -> torch.Tensor:
    return loaded.read() if isinstance(loaded, LazyTensor) else loaded


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor | LazyTensor) -> None:
    """Copy a checkpoint tensor (already this rank's part) into a parameter: same shape, cast to
    the parameter's dtype and device on the way."""
    loaded = materialize(loaded)
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(f"checkpoint tensor {tuple(loaded.shape)} does not fit parameter {tuple(param.shape)}")
    if not param.dtype.is_floating_point and loaded.dtype != param.dtype:  # packed bits: no value casts
        raise ValueError(f"checkpoint tensor of {loaded.dtype} where {param.dtype} is expected")
    with torch.no_grad():
        param.data.copy_(loaded)
