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


def untrusted_reason(path: Path, opened: os.stat_result | None = None) -> str | None:
    """Why code at `path` must not be loaded, or None. Loading a library runs it, so the file and
    every folder above it (symlinks resolved, as the loader opens it) must be owned by us or root
    and writable by no one else: otherwise another user could have swapped in a library of their
    own, or a folder on the way to it. A shared folder with the sticky bit (like /tmp) lets no one
    rename another user's entry, so it may be writable by all. `opened`: the file's fstat when
    the caller holds it open (what it checks is then what it loads)."""
    real = Path(os.path.realpath(path))
    for target in (real, *real.parents):
        try:
            info = opened if target is real and opened is not None else target.stat()
        except OSError as exc:
            return f"cannot inspect {target}: {exc.strerror}"
        problem = _foreign_writer(target, info, folder=target is not real)
        if problem:
            return problem
    return None


def _foreign_writer(target: Path, info: os.stat_result, folder: bool) -> str | None:
    if info.st_uid not in (os.getuid(), 0):
        return f"{target} belongs to another user (uid {info.st_uid})"
    sticky_folder = folder and info.st_mode & stat.S_ISVTX
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not sticky_folder:
        return f"{target} is writable by others (mode {stat.S_IMODE(info.st_mode):o})"
    return None
