"""What the prefix cache tells a router: blocks stored, blocks removed, everything cleared.

The three events of vLLM's KV-event stream, as plain data (process.kv_publisher puts them on the
wire). Hashes are the block manager's 32-byte chained hashes cut to their low 64 bits, read
big-endian: what vLLM publishes by default (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1), so one index
holds our engines' blocks and vLLM's.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def external_hash(block_hash: bytes) -> int:
    """A block hash as published: its last 8 bytes as an unsigned big-endian integer."""
    return int.from_bytes(block_hash[-8:], "big")


@dataclass(frozen=True)
class BlockStored:
    """Consecutive blocks of one sequence entered the cache: `block_hashes` in order, chained to
    `parent_block_hash` (None: the first is the sequence's first block); `token_ids` are the
    tokens of all of them, `block_size` per block; `lora_name` the LoRA adapter whose KV they hold."""

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_name: str | None = None


@dataclass
class BlockRemoved:
    """Blocks evicted from the cache (their KV is gone)."""

    block_hashes: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class AllBlocksCleared:
    """The whole cache is empty: a fresh engine, or a reset."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
