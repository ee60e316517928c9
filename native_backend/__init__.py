"""kvgate's own inference engine: paged KV cache, continuous batching, chunked prefill, prefix caching.

The engine's layers, each a package that imports only the layers below it (the layering test in
tests/gateway/test_layering.py checks it, and that nothing imports in a circle):

    tools/       the capacity planner and the int4 quantizer: commands over the engine's rules
    process/     the engine process, its async client, the messages between them
    execution/   executor, model runner, sampler, tensor-parallel workers, speculative proposers
    core/        engine loop, scheduler, block manager, sequences, batch DTOs (no torch)
    model/       layers, models, loader, quantization, attention, KV cache
    kernels/     the C kernels, their build, the ctypes calls the CPU path makes
    text/        tokenizer, detokenizer, stop strings
    config/      the engine's settings, the model's shape, where the cache lives (no torch)

`core` and `model` stand side by side: neither imports the other (the executor joins them).
This package never imports `gateway`; `plugins/native` adapts it to the gateway's Backend protocol.
"""
