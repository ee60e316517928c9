"""The KV connector's worker side (prefill/decode disaggregation; core.kv_connector decides):
blocks moved between engines over TCP, as they are stored.

    blocks.py     a cache's blocks to bytes and back (fp32, bf16, fp16, fp8 and int8, scales included)
    wire.py       the framing of one read: a JSON header each way, then the blocks' bytes
    server.py     a producer's listener: serves the blocks HeldBlocks grants, nothing else
    loader.py     a consumer's reads, on threads of their own, into staging buffers
    connector.py  both behind the core's KVTransferPort

A read never writes the cache from its thread: the step loop copies a finished read into its
blocks (`commit`), between steps. A producer's threads only read blocks that are held (referenced,
so never rewritten) while a read has them claimed.
"""
