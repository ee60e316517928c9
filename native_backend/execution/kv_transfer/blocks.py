"""A paged cache's blocks as bytes, in the order they are stored, and back.

    payload = for each layer: K blocks, V blocks        (n, block_size, kv_heads, head_dim), storage dtype
                              [int8: K scales, V scales  (n, block_size, kv_heads) float32]

fp8's per-layer scales are not in the payload: they are the same for every block, so they travel
in the layout (`layout()`), with a digest of a calibrated cache's key offsets (KVLayer.k_offset:
its keys are stored minus them), and a consumer whose layout differs (another dtype, shape, fp8
scales or key offsets) is refused the read and recomputes instead of misreading the bytes.

Under tensor parallelism the payload is every rank's, one after the other (rank 0's first), and
the layout lists each rank's (parallel.kv_relay); `LocalBlocks` is the one-rank case.
"""

from __future__ import annotations

import hashlib

import torch

from native_backend.model.kv_cache import KVCache, KVLayer


def layout(cache: KVCache) -> dict:
    """What both ends must agree on for the bytes to mean the same KV."""
    first = cache.layers[0]
    described = dict(dtype=cache.dtype.name, num_layers=cache.num_layers, block_size=cache.block_size,
                     num_kv_heads=cache.num_kv_heads, head_dim=cache.head_dim)
    if cache.dtype.scaling == "per_layer":
        described["scales"] = [[layer.k_scale, layer.v_scale] for layer in cache.layers]
    elif first.key_scales is not None:
        described["row_scales"] = True
    if any(layer.k_offset is not None for layer in cache.layers):
        described["k_offsets"] = key_offsets_digest(cache)
    return described


def key_offsets_digest(cache: KVCache) -> str:
    """sha256 of every layer's key offset (float32, as stored): two caches whose offsets differ by
    one bit store other bytes for the same keys. A digest, not the values: a large model's offsets
    (layers x kv_heads x head_dim floats) would not fit a read's header (wire.MAX_HEADER_BYTES)."""
    digest = hashlib.sha256()
    for layer in cache.layers:
        offset = layer.k_offset
        if offset is None:
            digest.update(b"none;")
            continue
        offset = offset.detach().to(device="cpu", dtype=torch.float32).contiguous()
        digest.update(repr(tuple(offset.shape)).encode() + b";")
        digest.update(offset.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _tensors(layer: KVLayer) -> list[torch.Tensor]:
    """A layer's per-block tensors, in payload order."""
    tensors = [layer.key, layer.value]
    if layer.key_scales is not None:
        tensors += [layer.key_scales, layer.value_scales]
    return tensors


def block_bytes(cache: KVCache) -> int:
    """Payload bytes of one block."""
    return sum(t[0].numel() * t.element_size() for layer in cache.layers for t in _tensors(layer))


def _rows(tensor: torch.Tensor) -> torch.Tensor:
    """A per-block tensor as (blocks, row) machine words: index_select and index_copy_ move 8-byte
    elements several times faster than bytes (a 4k-token fp32 payload: ~400 -> ~90 ms), and fp8
    has no index_copy_ kernel of its own. Bytes where a row is not a whole number of words."""
    raw = tensor.view(torch.uint8).view(tensor.shape[0], -1)
    return raw.view(torch.int64) if raw.shape[1] % 8 == 0 else raw


def read_blocks(cache: KVCache, block_ids: list[int]):
    """The blocks' bytes, one buffer per tensor (a generator: a producer sends each as it is read)."""
    index = torch.tensor(block_ids, dtype=torch.long, device=cache.device)
    for layer in cache.layers:
        for tensor in _tensors(layer):
            rows = _rows(tensor).index_select(0, index).contiguous().cpu()
            yield rows.view(torch.uint8).numpy().data  # fp8 has no numpy dtype: its bytes do


def write_blocks(cache: KVCache, block_ids: list[int], payload: bytearray) -> None:
    """Copy a payload (read_blocks' bytes of len(block_ids) blocks) into `block_ids`."""
    n = len(block_ids)
    if len(payload) != n * block_bytes(cache):
        raise ValueError(f"payload of {len(payload)} bytes for {n} blocks of {block_bytes(cache)}")
    raw = memoryview(payload)
    offset = 0

    def next_part(size: int):
        nonlocal offset
        offset += size
        return raw[offset - size:offset]

    receive_blocks(cache, block_ids, next_part)


def receive_blocks(cache: KVCache, block_ids: list[int], next_part) -> None:
    """Copy a payload into `block_ids` as it arrives, tensor by tensor: `next_part(nbytes)` gives
    the payload's next nbytes (a buffer), so at most one tensor's rows are staged at a time. A
    consumer's loader writes this way from its read's thread, beside the step loop: the blocks are
    its request's alone until the read ends (the scheduler frees an aborted read's blocks only
    then), and a read that breaks off leaves blocks the recomputed prompt overwrites."""
    index = torch.tensor(block_ids, dtype=torch.long, device=cache.device)
    n = len(block_ids)
    for layer in cache.layers:
        for tensor in _tensors(layer):
            target = _rows(tensor)
            part = next_part(n * target.shape[1] * target.element_size())
            rows = torch.frombuffer(part, dtype=torch.uint8) if n else torch.empty(0, dtype=torch.uint8)
            target.index_copy_(0, index, rows.view(target.dtype).view(n, target.shape[1]).to(cache.device))


class LocalBlocks:
    """The blocks of one cache in this process (an engine without tensor parallelism): what the
    server reads and the loader writes as it reads (`receive`); parallel.kv_relay.TensorParallelBlocks
    (every rank's, no `receive`: the workers' shards go on the step pipes) is committed by the
    step loop (`write`)."""

    tp_size = 1

    def __init__(self, cache: KVCache):
        self.cache = cache
        self.block_bytes = block_bytes(cache)

    def layout(self) -> dict:
        return layout(self.cache)

    def read(self, block_ids: list[int]):
        return read_blocks(self.cache, block_ids)

    def write(self, block_ids: list[int], payload: bytearray) -> None:
        write_blocks(self.cache, block_ids, payload)

    def receive(self, block_ids: list[int], next_part) -> None:
        """Write a payload as it is read (receive_blocks), off the step loop."""
        receive_blocks(self.cache, block_ids, next_part)


def layout_difference(ours: dict, theirs) -> str:
    """Why a consumer's layout is refused: the tensor-parallel sizes first (a shard of other KV
    heads), else the whole layout."""
    tp = ours.get("tensor_parallel_size", 1)
    their_tp = theirs.get("tensor_parallel_size", 1) if isinstance(theirs, dict) else None
    if their_tp != tp:
        return (f"the consumer runs tensor_parallel_size {their_tp}, this producer {tp}: its ranks hold other "
                "KV heads (producer and consumer need the same size)")
    if isinstance(theirs, dict):
        fields = sorted(key for key in ours.keys() | theirs.keys() if ours.get(key) != theirs.get(key))
        return f"the consumer's KV layout differs from this producer's in {', '.join(fields)}: {ours}"
    return f"the consumer's KV layout differs from this producer's {ours}"
