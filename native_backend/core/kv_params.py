"""vLLM's kv_transfer_params as this engine reads them, and the plain data of one remote read
(core.kv_connector decides what to read; execution.kv_transfer reads it). No torch, no state."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RemotePrefill:
    """Where a consumer reads a prompt's blocks: a producer's answer, as the decode request carries it."""

    engine_id: str
    request_id: str
    block_ids: tuple[int, ...]
    host: str
    port: int
    num_tokens: int | None = None  # prompt tokens the producer computed (None: an older vLLM's answer)


@dataclass(frozen=True)
class Endpoint:
    """This engine as producers are named in the params: who it is, where it serves blocks."""

    engine_id: str
    host: str
    port: int


def parse_transfer_params(params) -> RemotePrefill | bool | None:
    """A request's kv_transfer_params: RemotePrefill (decode here from a producer's blocks), True
    (prefill here for a remote decode), or None (neither). ValueError names the bad field."""
    if params is None:
        return None
    if not isinstance(params, dict):
        raise ValueError("kv_transfer_params: must be an object")
    if params.get("do_remote_prefill"):
        return _remote_prefill(params)
    return True if params.get("do_remote_decode") else None


def _remote_prefill(params: dict) -> RemotePrefill:
    def field_of(name: str, kind, optional: bool = False):
        value = params.get(name)
        if value is None and optional:
            return None
        if not isinstance(value, kind) or isinstance(value, bool):
            raise ValueError(f"kv_transfer_params.{name}: expected {kind.__name__}, got {type(value).__name__}")
        return value

    block_ids = field_of("remote_block_ids", list)
    if not all(type(b) is int and b >= 0 for b in block_ids):
        raise ValueError("kv_transfer_params.remote_block_ids: expected non-negative integers")
    port = field_of("remote_port", int)
    if not 0 < port < 65536:
        raise ValueError(f"kv_transfer_params.remote_port: {port} is not a port")
    return RemotePrefill(engine_id=field_of("remote_engine_id", str), request_id=field_of("remote_request_id", str),
                         block_ids=tuple(block_ids), host=field_of("remote_host", str), port=port,
                         num_tokens=field_of("remote_num_tokens", int, optional=True))


@dataclass
class KVLoad:
    """One consumer read: the producer's blocks `remote_block_ids` into this engine's
    `local_block_ids` (the same positions of the prompt), each block checked against its hash."""

    request_id: str
    source: RemotePrefill
    local_block_ids: list[int]
    remote_block_ids: list[int]
    block_hashes: list[bytes]
    first_block: int  # the position of local_block_ids[0] in the sequence's block table
    num_tokens: int  # the sequence's computed tokens once loaded (a whole number of blocks)

    @property
    def moved_tokens(self) -> int:
        """Tokens whose KV the read moves (its blocks; those before first_block were cached here)."""
        return self.num_tokens * len(self.local_block_ids) // (self.first_block + len(self.local_block_ids))
