"""The engine's C kernels for x86-64 CPUs (csrc/cpu_kernels.c): built once, loaded with ctypes.

The library is compiled on first use with the machine's C compiler (gcc or cc; `CC` overrides)
into the kvgate cache (`KVGATE_CACHE_DIR`, default ~/.cache/kvgate, under `kernels/`; or
`KVGATE_KERNELS_DIR`), named by
a hash of the source and the flags, so an edit builds anew, a library built elsewhere can be
copied in, and concurrent builds never see each other's half-written file (`python -m
native_backend.cpu_kernels` builds it ahead of time and prints its path). No compiler, a CPU without AVX2/FMA,
or `KVGATE_CPU_KERNELS=0` in the environment: `load()` returns None, says why in
`unavailable_reason()`, and callers keep their torch paths.

It must be loaded after torch: built with -fopenmp, it then shares torch's libgomp (and so its
thread pool and torch.set_num_threads) instead of starting a second OpenMP runtime.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger("kvgate.engine")

SOURCE = Path(__file__).with_name("csrc") / "cpu_kernels.c"
CFLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-fPIC", "-shared", "-fvisibility=hidden", "-std=c11"]
REQUIRED_CPU_FLAGS = ("avx2", "fma")

_i64, _f32, _ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
_SIGNATURES = {
    "kvgate_cpu_kernels_version": ([], ctypes.c_int),
    # out, q, cache_k, cache_v, block_tables, table_stride, row_seq, row_keys,
    # num_rows, num_heads, kv_heads, head_dim, block_size, scale, chunk_blocks
    "kvgate_paged_decode_f32": ([_ptr] * 5 + [_i64, _ptr, _ptr] + [_i64] * 5 + [_f32, _i64], ctypes.c_int),
    # y, x, w, bias, M, K, N
    "kvgate_linear_f32": ([_ptr] * 4 + [_i64] * 3, ctypes.c_int),
}

_state: dict = {}  # "lib": the loaded library or None, "reason": why None


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


# An x86-64 CPU with the instructions the kernels are compiled for (a compiler may still be missing).
PLATFORM_SUPPORTED = (platform.machine().lower() in ("x86_64", "amd64")
                      and all(f in _cpu_flags() for f in REQUIRED_CPU_FLAGS))


def load() -> ctypes.CDLL | None:
    """The kernel library, building it if needed; None when it cannot be had here (logged once)."""
    if "lib" not in _state:
        try:
            _state["lib"] = _load()
        except _Unavailable as exc:
            _state["lib"], _state["reason"] = None, str(exc)
            log.warning("CPU kernels unavailable (%s): using the torch paths", exc)
    return _state["lib"]


def available() -> bool:
    return load() is not None


def unavailable_reason() -> str | None:
    load()
    return _state.get("reason")


class _Unavailable(Exception):
    pass


def _load() -> ctypes.CDLL:
    if os.environ.get("KVGATE_CPU_KERNELS", "1").strip().lower() in ("0", "false", "no", "off"):
        raise _Unavailable("disabled by KVGATE_CPU_KERNELS")
    if platform.machine().lower() not in ("x86_64", "amd64"):
        raise _Unavailable(f"not an x86-64 machine ({platform.machine()})")
    missing = [f for f in REQUIRED_CPU_FLAGS if f not in _cpu_flags()]
    if missing:
        raise _Unavailable(f"the CPU lacks {', '.join(missing)}")
    path = _built_library()
    lib = ctypes.CDLL(str(path))
    for name, (argtypes, restype) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, restype
    return lib


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if not cc:
        raise _Unavailable("no C compiler (gcc or cc) on PATH")
    return cc


def library_path() -> Path:
    """Where the library for this source and these flags lives, built or not: `KVGATE_KERNELS_DIR`
    if set (a container image builds it there in its build stage, for a runtime without a
    compiler), else `kernels/` in the kvgate cache."""
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(CFLAGS).encode()).hexdigest()[:16]
    folder = os.environ.get("KVGATE_KERNELS_DIR")
    if not folder:
        folder = Path(os.environ.get("KVGATE_CACHE_DIR") or Path.home() / ".cache" / "kvgate") / "kernels"
    return Path(folder) / f"cpu_kernels-{key}.so"


def _built_library() -> Path:
    target = library_path()
    if target.exists():
        return target
    cc = _compiler()
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        try:
            done = subprocess.run([cc, *CFLAGS, str(SOURCE), "-o", tmp, "-lm"], capture_output=True, text=True,
                                  timeout=300)
        except (OSError, subprocess.SubprocessError) as exc:
            raise _Unavailable(f"{cc} does not run: {exc}") from None
        if done.returncode != 0:
            raise _Unavailable(f"{cc} failed: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, target)  # atomic: another process sees the whole file or none
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    log.info("built CPU kernels: %s", target)
    return target


# ------------------------------------------------------------------------------ torch-facing calls


def paged_decode(
    q: torch.Tensor,  # (num_rows, num_heads, head_dim) float32
    cache_k: torch.Tensor,  # (num_blocks, block_size, kv_heads, head_dim) float32
    cache_v: torch.Tensor,
    block_tables: torch.Tensor,  # (num_seqs, max_blocks) int64
    row_seq: torch.Tensor,  # (num_rows,) int64: the sequence of each row
    row_keys: torch.Tensor,  # (num_rows,) int64: how many leading positions each row attends to
    scale: float,
    chunk_blocks: int | None = None,  # blocks per work item; None: `default_chunk_blocks`
) -> torch.Tensor:  # (num_rows, num_heads, head_dim)
    """One query per row, attending its sequence's first row_keys[r] cached positions."""
    q = q.contiguous()
    out = torch.empty_like(q)
    num_rows, num_heads, head_dim = q.shape
    _, block_size, kv_heads, _ = cache_k.shape
    rc = load().kvgate_paged_decode_f32(
        out.data_ptr(), q.data_ptr(), cache_k.data_ptr(), cache_v.data_ptr(), block_tables.data_ptr(),
        block_tables.stride(0), row_seq.data_ptr(), row_keys.data_ptr(), num_rows, num_heads, kv_heads,
        head_dim, block_size, scale, chunk_blocks or default_chunk_blocks(row_keys, block_size))
    if rc != 0:
        raise RuntimeError(f"kvgate_paged_decode_f32 failed ({rc})")
    return out


def default_chunk_blocks(row_keys: torch.Tensor, block_size: int) -> int:
    """Blocks per work item of `paged_decode`: about 8 items per thread, so that a batch of one long
    sequence still keeps every thread busy, and at most 32 blocks (few merges for long rows)."""
    total_blocks = int(row_keys.sum()) // block_size + row_keys.numel()
    return max(2, min(32, total_blocks // (8 * torch.get_num_threads())))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for float32 x (M, K) with small M; weight (N, K) contiguous, K a multiple of 8."""
    x = x.contiguous()
    m, k = x.shape
    n = weight.shape[0]
    y = x.new_empty((m, n))
    rc = load().kvgate_linear_f32(y.data_ptr(), x.data_ptr(), weight.data_ptr(),
                                  bias.data_ptr() if bias is not None else None, m, k, n)
    if rc != 0:
        raise RuntimeError(f"kvgate_linear_f32 failed ({rc})")
    return y


if __name__ == "__main__":  # build ahead of time (a container's build stage): prints the path
    import sys

    logging.basicConfig(level=logging.INFO)
    if load() is None:
        sys.exit(f"CPU kernels unavailable: {unavailable_reason()}")
    print(library_path())
