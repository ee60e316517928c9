"""kvgate's own inference engine: paged KV cache, continuous batching, chunked prefill, prefix caching.

This package never imports `gateway`; `plugins/native` adapts it to the gateway's Backend protocol.
"""
