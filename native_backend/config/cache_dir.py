"""Where kvgate keeps what it unpacks or builds once (GGUF tokenizers, the CPU kernels).

Plain standard library: the gateway side (the native plugin) reads it without importing torch."""

from __future__ import annotations

import os
import stat
from pathlib import Path


def kvgate_cache_dir() -> Path:
    """`KVGATE_CACHE_DIR`, default ~/.cache/kvgate (the container images point it at /cache/kvgate)."""
    return Path(os.environ.get("KVGATE_CACHE_DIR") or Path.home() / ".cache" / "kvgate")


def tokenizer_cache_dir() -> Path:
    """Where a GGUF's tokenizer is unpacked once (the native plugin, the benchmarks)."""
    return kvgate_cache_dir() / "tokenizers"


def untrusted_reason(path: Path) -> str | None:
    """Why code at `path` must not be loaded, or None. Loading a library runs it, so the file and
    its folder must be writable by no one but their owner, and owned by us or root: otherwise
    another user could have swapped in a library of their own. A shared folder with the sticky
    bit (like /tmp) lets no one replace another user's file, so only the file counts there."""
    for target in (path, path.parent):
        try:
            info = target.stat()
        except OSError as exc:
            return f"cannot inspect {target}: {exc.strerror}"
        if info.st_uid not in (os.getuid(), 0):
            return f"{target} belongs to another user (uid {info.st_uid})"
        sticky_dir = target is not path and info.st_mode & stat.S_ISVTX
        if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not sticky_dir:
            return f"{target} is writable by others (mode {stat.S_IMODE(info.st_mode):o})"
    return None
