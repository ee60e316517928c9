"""The KV connector's worker side behind the core's KVTransferPort: a producer's server, a
consumer's loader, or both (kv_role), over this engine's KV blocks: its cache's, or under tensor
parallelism every rank's (parallel.kv_relay.TensorParallelBlocks, which the factory passes)."""

from __future__ import annotations

import json
import uuid

from native_backend.config.engine import KVTransferOptions
from native_backend.core.kv_connector import HeldBlocks
from native_backend.core.kv_params import Endpoint, KVLoad
from native_backend.execution.kv_transfer.blocks import LocalBlocks
from native_backend.execution.kv_transfer.loader import KVBlockLoader, LoadOutcome
from native_backend.execution.kv_transfer.server import KVBlockServer
from native_backend.execution.kv_transfer.trust import ProducerAllowList, transfer_key
from native_backend.model.kv_cache import KVCache


class KVConnectorWorker:
    def __init__(self, options: KVTransferOptions, blocks):
        self.blocks = blocks  # LocalBlocks, or TensorParallelBlocks: layout, block_bytes, read, write
        self.tp_size = blocks.tp_size  # the answer's tp_size
        # A new id per engine process: params from before a restart name an engine that is gone.
        engine_id = uuid.uuid4().hex
        self.held = HeldBlocks(engine_id)
        described = json.loads(json.dumps(blocks.layout()))  # as a peer compares it: through JSON
        self.server = None
        self.endpoint = None
        key = transfer_key(options.kv_transfer_key_env)
        if options.produces:
            self.server = KVBlockServer(blocks, self.held, options.kv_transfer_host, options.kv_transfer_port,
                                        options.kv_transfer_max_connections, key=key)
            self.endpoint = Endpoint(engine_id, options.advertised_host, self.server.port)
        self.loader = KVBlockLoader(
            described, blocks.block_bytes, options.kv_transfer_timeout_s, getattr(blocks, "receive", None),
            allowed=ProducerAllowList(options.kv_allowed_producers), key=key,
            header_timeout_s=options.kv_transfer_header_timeout_s) if options.consumes else None

    def describe(self) -> str:
        serving = f"serving KV blocks on {self.endpoint.host}:{self.endpoint.port}" if self.endpoint else ""
        reading = "reading KV blocks from producers" if self.loader else ""
        return ", ".join(part for part in (serving, reading) if part)

    def start_loads(self, loads: list[KVLoad]) -> None:
        for load in loads:
            self.loader.start(load)

    def take_finished(self) -> list[LoadOutcome]:
        return self.loader.take_finished() if self.loader is not None else []

    def commit(self, result: LoadOutcome) -> None:
        """A read's staged payload into its blocks (nothing to do for one written as it was read)."""
        payload, result.payload = result.payload, None
        if payload is not None:
            self.blocks.write(result.load.local_block_ids, payload)

    def wait(self, timeout: float) -> None:
        if self.loader is not None:
            self.loader.wait(timeout)

    def close(self) -> None:
        if self.server is not None:
            self.server.close()


def make_kv_transfer(options: KVTransferOptions, blocks) -> KVConnectorWorker | None:
    """The connector's worker side for a kv_role over `blocks` (a KVCache: this process's one
    rank; or TensorParallelExecutor.kv_blocks()); None without a kv_role."""
    if options.kv_role is None:
        return None
    return KVConnectorWorker(options, LocalBlocks(blocks) if isinstance(blocks, KVCache) else blocks)
