"""The paged KV cache: preallocated per-layer key/value blocks, and the arithmetic that sizes it.

Layout of one layer's key (or value) tensor:

    (num_blocks, block_size, num_kv_heads, head_dim)
       block b, offset o  <->  slot = b * block_size + o  (the flat row `slot_mapping` names)

Sizing follows the budget operators use (vLLM's `gpu_memory_utilization`):

    usable = total_memory * memory_fraction
    kv     = usable - weights - activations - reserve          (or an explicit byte budget)
    bytes/token = 2 (K and V) * layers * kv_heads * head_dim * bytes/element
    blocks = kv // (bytes/token * block_size)
    full-context sequences = blocks // ceil(max_model_len / block_size)
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import torch

from native_backend.config.formats import KV_FORMATS, KVFormat, kv_format

# ------------------------------------------------------------------------------ element types


@dataclass(frozen=True)
class KVCacheDType(KVFormat):
    """A KV format (config.formats: its bytes, scaling, kernel code) and the torch dtype it is
    stored in."""

    storage: torch.dtype = field(kw_only=True)


_STORAGE = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
            "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2, "int8": torch.int8}
KV_CACHE_DTYPES: dict[str, KVCacheDType] = {
    name: KVCacheDType(**vars(fmt), storage=_STORAGE[name]) for name, fmt in KV_FORMATS.items()}


def resolve_kv_dtype(dtype: str | torch.dtype | KVCacheDType) -> KVCacheDType:
    if isinstance(dtype, KVCacheDType):
        return dtype
    if isinstance(dtype, torch.dtype):
        dtype = str(dtype).removeprefix("torch.")
    return KV_CACHE_DTYPES[kv_format(dtype).name]


# ------------------------------------------------------------------------------ sizing (pure)


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, bytes_per_element: int,
                       scale_bytes_per_head: int = 0) -> int:
    """K and V, every layer, one token; int8 adds its per-token, per-head scale."""
    return 2 * num_layers * num_kv_heads * (head_dim * bytes_per_element + scale_bytes_per_head)


@dataclass(frozen=True)
class KVCachePlan:
    """What a memory budget buys: report this at startup."""

    bytes_per_token: int
    block_size: int  # tokens per block
    bytes_per_block: int
    num_blocks: int
    kv_cache_bytes: int  # num_blocks * bytes_per_block (<= the budget)
    max_model_len: int  # the context length one sequence may reach
    blocks_per_full_sequence: int
    full_context_sequences: int  # sequences that fit at once when all reach max_model_len

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size


def plan_kv_cache(
    *,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    bytes_per_element: int,
    block_size: int,
    max_model_len: int,
    scale_bytes_per_head: int = 0,
    kv_cache_bytes: int | None = None,
    memory_fraction: float | None = None,
    total_memory_bytes: int | None = None,
    weights_bytes: int = 0,
    activation_bytes: int = 0,
    reserve_bytes: int = 0,
) -> KVCachePlan:
    """Blocks for an explicit `kv_cache_bytes`, or for `memory_fraction` of `total_memory_bytes`
    minus weights, activations and reserve. Raises when the budget cannot hold a single block."""
    budget = _kv_budget(kv_cache_bytes, memory_fraction, total_memory_bytes, weights_bytes, activation_bytes, reserve_bytes)
    per_token = kv_bytes_per_token(num_layers, num_kv_heads, head_dim, bytes_per_element, scale_bytes_per_head)
    per_block = per_token * block_size
    num_blocks = budget // per_block
    if num_blocks < 1:
        raise ValueError(f"KV cache budget of {budget} bytes is below one block ({per_block} bytes)")
    blocks_per_seq = math.ceil(max_model_len / block_size)
    return KVCachePlan(
        bytes_per_token=per_token,
        block_size=block_size,
        bytes_per_block=per_block,
        num_blocks=num_blocks,
        kv_cache_bytes=num_blocks * per_block,
        max_model_len=max_model_len,
        blocks_per_full_sequence=blocks_per_seq,
        full_context_sequences=num_blocks // blocks_per_seq,
    )


def _kv_budget(kv_cache_bytes, memory_fraction, total_memory_bytes, weights, activations, reserve) -> int:
    if kv_cache_bytes is not None:
        if memory_fraction is not None:
            raise ValueError("give either kv_cache_bytes or memory_fraction, not both")
        return int(kv_cache_bytes)
    if memory_fraction is None or total_memory_bytes is None:
        raise ValueError("give kv_cache_bytes, or memory_fraction with total_memory_bytes")
    if not 0.0 < memory_fraction <= 1.0:
        raise ValueError(f"memory_fraction must be in (0, 1], got {memory_fraction}")
    return int(total_memory_bytes * memory_fraction) - weights - activations - reserve


def device_memory_bytes(device: torch.device | str) -> int:
    """Total memory of the device the cache will live on (physical RAM for the CPU)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[1]
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


# ------------------------------------------------------------------------------ the cache


@dataclass(eq=False)
class KVLayer:
    """One attention layer's slice of the paged cache: what the attention backends receive.

    key, value: (num_blocks, block_size, kv_heads, head_dim) in the storage dtype, this rank's
    KV heads only. Scaled formats keep their scales here too, so a backend needs nothing else."""

    key: torch.Tensor
    value: torch.Tensor
    dtype: KVCacheDType
    k_scale: float = 1.0  # per-layer formats (fp8): stored = fp8(x / k_scale)
    v_scale: float = 1.0
    # fp8 with calibrated scales: (kv_heads, head_dim) float32, the keys' mean over the calibration
    # text, subtracted from every key before it is stored (`Attention.forward`). A query's scores
    # all move by q . k_offset, which softmax ignores, while fp8's error, relative to each value,
    # shrinks with the values (kv_scales: why). None: keys stored as they are.
    k_offset: torch.Tensor | None = None
    # per-token formats (int8): (num_blocks, block_size, kv_heads) float32, one scale per row
    key_scales: torch.Tensor | None = None
    value_scales: torch.Tensor | None = None
    # per-layer formats (fp8): (2, kv_heads) int64, how many K (row 0) and V (row 1) values of each
    # KV head were beyond the format's range after scaling and clamped when written (a scale too
    # small for the traffic: kv_scales.clamp_report, the engine's kv_clamped_* counters).
    clamped: torch.Tensor | None = None

    @classmethod
    def allocate(cls, *, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: str | torch.dtype | KVCacheDType = "float32", device="cpu") -> KVLayer:
        kv_dtype = resolve_kv_dtype(dtype)
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        # zeros, not empty: padded block-table entries point at block 0 and are masked, but
        # masked garbage that happens to be NaN would still poison a matmul.
        key = torch.zeros(shape, dtype=kv_dtype.storage, device=device)
        return cls(key, torch.zeros_like(key), kv_dtype)._with_row_scales()

    @classmethod
    def of(cls, key: torch.Tensor, value: torch.Tensor) -> KVLayer:
        """Caches that already exist (tests, tools): the dtype follows the tensors'; an int8 cache
        gets zeroed row scales, an fp8 one unit scales."""
        return cls(key, value, resolve_kv_dtype(key.dtype))._with_row_scales()

    def _with_row_scales(self) -> KVLayer:
        """int8: zeroed row scales (num_blocks, block_size, kv_heads) beside the blocks; fp8: zeroed
        clamp counters; others: as is."""
        if self.dtype.scaling == "per_token_head":
            self.key_scales = torch.zeros(self.key.shape[:3], dtype=torch.float32, device=self.key.device)
            self.value_scales = torch.zeros_like(self.key_scales)
        elif self.dtype.scaling == "per_layer":
            self.clamped = torch.zeros((2, self.key.shape[2]), dtype=torch.int64, device=self.key.device)
        return self

    @property
    def num_blocks(self) -> int:
        return self.key.shape[0]

    @property
    def block_size(self) -> int:
        return self.key.shape[1]

    @property
    def num_kv_heads(self) -> int:
        return self.key.shape[2]

    @property
    def head_dim(self) -> int:
        return self.key.shape[3]

    @property
    def nbytes(self) -> int:
        tensors = (self.key, self.value, self.key_scales, self.value_scales)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class KVCache:
    """Preallocated K/V blocks for every layer, one `KVLayer` each. The block manager hands out
    block ids; each attention layer writes its rows by slot and reads them by block table."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: str | torch.dtype = "float32",
        device: torch.device | str = "cpu",
    ):
        self.dtype = resolve_kv_dtype(dtype)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.device = torch.device(device)
        self.layers = [KVLayer.allocate(num_blocks=num_blocks, block_size=block_size, num_kv_heads=num_kv_heads,
                                        head_dim=head_dim, dtype=self.dtype, device=self.device)
                       for _ in range(num_layers)]

    @classmethod
    def for_model(cls, config, *, num_blocks: int, block_size: int, dtype="float32", device="cpu") -> KVCache:
        return cls(
            num_layers=config.num_layers,
            num_blocks=num_blocks,
            block_size=block_size,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            dtype=dtype,
            device=device,
        )

    def layer(self, index: int) -> KVLayer:
        return self.layers[index]

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)
