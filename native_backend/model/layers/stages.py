"""Which decoder layers this pipeline stage holds: the model's layers split into P consecutive runs.

    30 layers, 4 stages (even):   stage 0 [0..7)   1 [7..15)   2 [15..23)   3 [23..30)
                                  (the remainder goes to the stages before the last, as vLLM's
                                  get_pp_indices: the last one also runs the final norm and LM head)
    a given partition (7, 8, 8, 7) says each stage's count itself

    stage 0:  embedding, its layers ──(residual, delta)──> stage 1: its layers ──> ... last stage:
              its layers, the final norm, the LM head (sampling). A tied head's last stage keeps
              the embedding's matrix for the head.

One stage of one (size 1) holds every layer: the single-stage model is the degenerate case.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StageSpec:
    index: int = 0
    size: int = 1
    start: int = 0  # first decoder layer held
    end: int | None = None  # one past the last held; None: every layer to the model's end

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.size - 1

    def holds(self, layer: int, num_layers: int) -> bool:
        return self.start <= layer < (num_layers if self.end is None else self.end)

    def layer_range(self, num_layers: int) -> range:
        return range(self.start, num_layers if self.end is None else self.end)


WHOLE = StageSpec()


def partition_layers(num_layers: int, size: int, partition: Sequence[int] | None = None) -> list[int]:
    """Each stage's number of layers: `partition` checked, else as even as it goes, the remainder
    one layer each to the stages before the last (vLLM's rule). Raises ValueError naming why."""
    if partition is not None:
        if len(partition) != size or sum(partition) != num_layers or min(partition) < 1:
            raise ValueError(f"parallel.pipeline_layer_partition {list(partition)}: needs {size} counts of at least "
                             f"1 layer that add up to the model's {num_layers} layers")
        return list(partition)
    if not 1 <= size <= num_layers:
        raise ValueError(f"parallel.pipeline_parallel_size: {size} stages cannot split {num_layers} layers "
                         f"(each stage needs at least one; valid sizes for this model: 1..{num_layers})")
    counts = [num_layers // size] * size
    for i in range(num_layers % size):
        counts[-2 - i] += 1
    return counts


def stage_spec(index: int, num_layers: int, size: int, partition: Sequence[int] | None = None) -> StageSpec:
    """Stage `index` of `size` over `num_layers` layers (partition_layers)."""
    if size == 1:
        return WHOLE
    counts = partition_layers(num_layers, size, partition)
    start = sum(counts[:index])
    return StageSpec(index, size, start, start + counts[index])
