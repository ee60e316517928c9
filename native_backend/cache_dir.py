"""Where kvgate keeps what it unpacks or builds once (GGUF tokenizers, the CPU kernels).

Plain standard library: the gateway side (the native plugin) reads it without importing torch."""

from __future__ import annotations

import os
from pathlib import Path


def kvgate_cache_dir() -> Path:
    """`KVGATE_CACHE_DIR`, default ~/.cache/kvgate (the container images point it at /cache/kvgate)."""
    return Path(os.environ.get("KVGATE_CACHE_DIR") or Path.home() / ".cache" / "kvgate")


def tokenizer_cache_dir() -> Path:
    """Where a GGUF's tokenizer is unpacked once (the native plugin, the benchmarks)."""
    return kvgate_cache_dir() / "tokenizers"
