"""Per-rank resident bytes for the start-up line: what each rank holds 1/N of, and what every rank
holds whole (named), so an operator can check that N ranks really divide the model.

    split                       q/k/v/o, gate/up/down, embedding and LM head rows: 1/N each
    replicated: norms           RMSNorm weights (hidden-sized vectors)
    replicated: row biases      o_proj/down_proj biases, added once after the all-reduce
    replicated: k/v (N > kv)    k/v projections when there are fewer KV heads than ranks
"""

from __future__ import annotations

from torch import nn

from native_backend.model.layers.linear import RowParallelLinear

SPLIT = "split"
NORMS = "replicated: norms"
ROW_BIASES = "replicated: row-parallel biases"
KV_REPLICATED = "replicated: k/v projections (fewer KV heads than ranks)"


def weight_bytes_by_kind(model: nn.Module, size: int) -> dict[str, int]:
    """Bytes of every parameter (a tied head counted once, with the embedding), by kind."""
    kinds: dict[str, int] = {}
    seen: set[int] = set()
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            kind = _kind(module, name, size)
            kinds[kind] = kinds.get(kind, 0) + param.numel() * param.element_size()
    return kinds


def _kind(module: nn.Module, name: str, size: int) -> str:
    shard = getattr(module, "shard", None)
    if shard is None:
        return NORMS
    if shard.size < size:
        return KV_REPLICATED
    if isinstance(module, RowParallelLinear) and name == "bias":
        return ROW_BIASES
    return SPLIT


def mib(n: int | float) -> str:
    return f"{n / 2**20:.1f} MiB"


def describe_rank(report: dict, pipeline: bool = False) -> str:
    kinds = report["weights_by_kind"]
    replicated = ", ".join(f"{k.removeprefix('replicated: ')} {mib(v)}" for k, v in kinds.items() if k != SPLIT)
    stage = f" (stage {report['stage']}, {report['num_layers']} layers)" if pipeline else ""
    return (f"rank {report['rank']}{stage}: weights {mib(report['weights_bytes'])} (split {mib(kinds.get(SPLIT, 0))}; "
            f"replicated {replicated or 'nothing'}), KV {mib(report['kv_cache_bytes'])} "
            f"({report['num_kv_heads']} KV heads/layer, {report['kv_bytes_per_token']} B/token)")
