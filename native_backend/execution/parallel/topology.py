"""Where a rank sits among TP x PP ranks, and the groups and links it needs.

    rank = stage x TP + TP rank           TP 2 x PP 2:   stage 0: ranks 0 1    stage 1: ranks 2 3
                                                          (rank 0: the engine process; the last
                                                          stage's TP rank 0, here rank 2, samples)
    a stage's TP ranks all-reduce among themselves (their own group; with one stage, the default
    group); rank r sends its stage's output to rank r + TP (stage_link)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from native_backend.config.engine import EngineConfig
from native_backend.execution.parallel.stage_link import StageLink
from native_backend.model.layers.sharding import CommStats, GroupHandle, ShardSpec
from native_backend.model.layers.stages import StageSpec, stage_spec


@dataclass(frozen=True)
class Topology:
    tp: int = 1
    pp: int = 1

    @classmethod
    def of(cls, config: EngineConfig) -> Topology:
        return cls(config.parallel.tensor_parallel_size, config.parallel.pipeline_parallel_size)

    @property
    def world(self) -> int:
        return self.tp * self.pp

    @property
    def sampler_rank(self) -> int:
        """The last stage's TP rank 0: it gathers the LM head's slices and samples."""
        return (self.pp - 1) * self.tp

    def stage_of(self, rank: int) -> int:
        return rank // self.tp

    def stage_ranks(self, stage: int) -> tuple[int, ...]:
        return tuple(range(stage * self.tp, (stage + 1) * self.tp))


def rank_layout(config: EngineConfig, rank: int, num_layers: int,
                comm: CommStats | None = None) -> tuple[ShardSpec, StageSpec]:
    """This rank's shard (its TP rank in its stage's group) and its stage's layers."""
    topo = Topology.of(config)
    stage = topo.stage_of(rank)
    group = GroupHandle(topo.stage_ranks(stage)) if topo.pp > 1 and topo.tp > 1 else None
    shard = ShardSpec(rank % topo.tp, topo.tp, comm, group)
    return shard, stage_spec(stage, num_layers, topo.pp, config.parallel.pipeline_layer_partition)


def join_stage_groups(topo: Topology, shard: ShardSpec) -> None:
    """Every rank makes every stage's TP group, in stage order (torch.distributed's rule for
    new_group), and keeps its own. Nothing to make with one stage or one rank per stage."""
    if topo.pp == 1 or topo.tp == 1:
        return
    import torch.distributed as dist

    for stage in range(topo.pp):
        group = dist.new_group(list(topo.stage_ranks(stage)))
        if shard.group is not None and shard.group.ranks == topo.stage_ranks(stage):
            shard.group.pg = group


def stage_link(topo: Topology, rank: int, hidden_size: int, dtype: torch.dtype, device: torch.device):
    """The rank's StageLink (None with one stage)."""
    if topo.pp == 1:
        return None
    stage = topo.stage_of(rank)
    return StageLink(rank - topo.tp if stage > 0 else None, rank + topo.tp if stage < topo.pp - 1 else None,
                     hidden_size, dtype, device)
