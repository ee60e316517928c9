"""Which part of a tensor this rank holds, and how a checkpoint tensor becomes that part.

    a dimension of n split across size ranks:   rank r holds [r * n/size, (r+1) * n/size)

    n = 12, size = 3:   rank 0 [0..4)   rank 1 [4..8)   rank 2 [8..12)

One rank of one (size 1) is the whole tensor: the single-device engine is the degenerate case of
tensor parallelism, not a separate code path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class ShardSpec:
    rank: int = 0
    size: int = 1

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

    def all_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """Sum of every rank's partial result (the tensor-parallel group's collective)."""
        if self.size == 1:
            return partial
        import torch.distributed as dist

        dist.all_reduce(partial)
        return partial


SINGLE = ShardSpec()


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    """Copy a checkpoint tensor (already this rank's part) into a parameter: same shape, cast to
    the parameter's dtype and device on the way."""
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(f"checkpoint tensor {tuple(loaded.shape)} does not fit parameter {tuple(param.shape)}")
    if not param.dtype.is_floating_point and loaded.dtype != param.dtype:  # packed bits: no value casts
        raise ValueError(f"checkpoint tensor of {loaded.dtype} where {param.dtype} is expected")
    with torch.no_grad():
        param.data.copy_(loaded)
