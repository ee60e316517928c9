"""The engine's C kernels for x86-64 CPUs (csrc/*.c): built once per CPU generation, loaded with ctypes.

The same sources are compiled into one library per kernel path (`PATHS`): `avx2` (AVX2 + FMA,
the floor) and `avx512` (AVX-512 F/BW/VL/DQ: the sources' `#ifdef __AVX512F__` parts and the
compiler's 512-bit code). At load the best path this CPU runs is chosen (its
/proc/cpuinfo flags); one that does not build (a compiler without AVX-512) or load falls back to
the next, with a warning. `KVGATE_CPU_ISA=avx2|avx512` forces one path (tests, benchmarks): a
CPU without it then has no kernels, and says why. `path()` names the one that runs.

Each library is compiled on first use with the machine's C compiler (gcc or cc; `CC` overrides)
into `KVGATE_KERNELS_DIR` if set, else `kernels/` in the kvgate cache (`KVGATE_CACHE_DIR`,
default ~/.cache/kvgate), named by its path and a hash of the sources and the flags: an edit
builds anew, a library built elsewhere can be copied in, and concurrent builds never see each
other's half-written file (each compiles to a temporary name, then renames it in place). A
library that another user could have written (the file or any folder above it writable by group
or others without the sticky bit, or owned by someone else) is refused, not loaded: loading it
would run their code. The build records the library's sha256 beside it (`<library>.sha256`; copy
both to move a library built elsewhere); a library whose bytes differ from the record is rebuilt,
or refused where it cannot be, and the checked file is loaded through the descriptor that was
checked. `python -m native_backend.kernels.cpu_kernels` builds every path ahead of time (a
container's build stage: the machine that runs the image may have another CPU) and prints their
files. No compiler, a CPU without AVX2/FMA, or `KVGATE_CPU_KERNELS=0` in the environment: `load()`
returns None, `unavailable_reason()` says why, and callers keep their torch paths;
`unsupported_reason()` tells a machine that cannot run them (its CPU, or the variables) from a
compiler that is missing or fails and a library that does not load (a fault).

It must be loaded after torch: built with -fopenmp, it then shares torch's libgomp (and so its
thread pool and torch.set_num_threads) instead of starting a second OpenMP runtime.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from native_backend.config.cache_dir import kvgate_cache_dir, untrusted_reason

log = logging.getLogger("kvgate.engine")

CSRC = Path(__file__).with_name("csrc")
SOURCES = tuple(CSRC / f for f in ("cpu_kernels.c", "prefill_attention.c", "prefill_attention_bf16.c", "layer_ops.c",
                                   "decode_step.c", "int4_linear.c", "kv_quant.c"))
HEADERS = (CSRC / "simd_math.h", CSRC / "kernels.h")
# -Bsymbolic: decode_step.c's calls to the other kernels stay inside their own library, when two
# paths' libraries are loaded in one process (tests, benchmarks) with the same symbol names.
CFLAGS = ["-O3", "-fopenmp", "-fPIC", "-shared", "-fvisibility=hidden", "-std=c11", "-Wl,-Bsymbolic"]
INT4_CPU_FLAGS = ("f16c",)  # the int4 kernel's fp16 scales, besides AVX2/FMA (kvgate_int4_supported)


@dataclasses.dataclass(frozen=True)
class KernelPath:
    """One build of the kernel sources: the instructions it is compiled for, and the /proc/cpuinfo
    flags a CPU needs to run it."""

    name: str
    cflags: tuple[str, ...]
    cpu_flags: tuple[str, ...]
    summary: str  # for the start-up line and the docs


AVX2 = KernelPath("avx2", ("-mavx2", "-mfma"), ("avx2", "fma"), "AVX2 + FMA")
# Skylake-SP and later Xeons, Zen 4/5. VNNI and BF16 are not asked for: they would shut out CPUs
# without them (Skylake-SP, Cascade Lake). The one bf16 kernel (prefill_attention_bf16.c) asks for
# AVX512_BF16 per function and checks the CPU at run time (bf16_prefill_problem).
AVX512 = KernelPath("avx512",
                    ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq",
                     "-mprefer-vector-width=512"),
                    ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq"),
                    "AVX-512 F/BW/VL/DQ")
PATHS = (AVX512, AVX2)  # best first: the first this CPU runs (and that builds) is chosen
FLOOR = PATHS[-1]

_i64, _f32, _ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
_SIGNATURES = {
    # out, q, cache_k, cache_v, block_tables, table_stride, row_seq, row_keys,
    # num_rows, num_heads, kv_heads, head_dim, block_size, scale, chunk_blocks
    "kvgate_paged_decode_f32": ([_ptr] * 5 + [_i64, _ptr, _ptr] + [_i64] * 5 + [_f32, _i64], ctypes.c_int),
    # y, x, w, bias, M, K, N
    "kvgate_linear_f32": ([_ptr] * 4 + [_i64] * 3, ctypes.c_int),
    # cache_k, cache_v, k, v, slots, n, row
    "kvgate_write_kv_f32": ([_ptr] * 5 + [_i64] * 2, ctypes.c_int),
    # residual, delta, weight, out, M, D, eps
    "kvgate_add_rms_norm_f32": ([_ptr] * 4 + [_i64] * 2 + [_f32], ctypes.c_int),
    # q, k, positions, cos, sin, n, q_heads, k_heads, head_dim
    "kvgate_rope_qk_f32": ([_ptr] * 5 + [_i64] * 4, ctypes.c_int),
    # out, gate, up, M, N
    "kvgate_silu_mul_f32": ([_ptr] * 3 + [_i64] * 2, ctypes.c_int),
    # out, q, cache_k, cache_v, blocks, q_len, ctx, num_heads, kv_heads, head_dim, block_size, scale
    "kvgate_prefill_attention_f32": ([_ptr] * 5 + [_i64] * 6 + [_f32], ctypes.c_int),
    # the same, bf16 products (prefill_attention_bf16.c: the avx512 build on a CPU with AVX512_BF16)
    "kvgate_prefill_attention_bf16": ([_ptr] * 5 + [_i64] * 6 + [_f32], ctypes.c_int),
    # out, q, kv (kvg_kv), block_tables, table_stride, row_seq, row_keys,
    # num_rows, num_heads, kv_heads, head_dim, block_size, scale, chunk_blocks
    "kvgate_paged_decode_q": ([_ptr] * 4 + [_i64, _ptr, _ptr] + [_i64] * 5 + [_f32, _i64], ctypes.c_int),
    # cache_k, cache_v, k_scales, v_scales, k, v, slots, n, kv_heads, D, fmt, k_scale, v_scale, clamped
    "kvgate_write_kv_q": ([_ptr] * 7 + [_i64] * 3 + [ctypes.c_int, _f32, _f32, _ptr], ctypes.c_int),
    # layers, num_layers, dims, step, final_norm, h, out, M (structs: models/fused_decode.py)
    "kvgate_decode_layers_f32": ([_ptr, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _i64], ctypes.c_int),
    # y, x, qweight, qzeros, scales, bias, M, K, N, group (int4_linear.c)
    "kvgate_int4_linear_f32": ([_ptr] * 6 + [_i64] * 4, ctypes.c_int),
    # y, x, qweight, offsets, scales, bias, M, K, N, group (int4_linear.c: GGUF Q4_0 / Q4_1 repacked)
    "kvgate_int4_linear_off_f32": ([_ptr] * 6 + [_i64] * 4, ctypes.c_int),
    "kvgate_int4_supported": ([], ctypes.c_int),
    "kvgate_vector_bits": ([], ctypes.c_int),  # 512: the AVX-512 build, 256: the AVX2 one
    # y, x, w8, scale, M, K, N (int4_linear.c: an int4 model's LM head)
    "kvgate_int8_rows_f32": ([_ptr] * 4 + [_i64] * 3, ctypes.c_int),
}


@functools.cache
def _cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def _platform_problem(path: KernelPath = FLOOR) -> str | None:
    """Why this machine cannot run `path`'s instructions, or None."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"not an x86-64 machine ({platform.machine()})"
    missing = [f for f in path.cpu_flags if f not in _cpu_flags()]
    return f"the CPU lacks {', '.join(missing)}" if missing else None


# An x86-64 CPU with the instructions of the AVX2 floor (a compiler may still be missing).
PLATFORM_SUPPORTED = _platform_problem() is None


def unsupported_reason(int4: bool = False, path: str | None = None) -> str | None:
    """Why the kernels (with `int4`, the int4 kernel too; with `path`, that path's build) cannot run
    on this machine by design (not x86-64, a CPU without the instructions, turned off by
    KVGATE_CPU_KERNELS=0, a path forced by KVGATE_CPU_ISA that the CPU lacks), or None. None does
    not mean they work here: a library that fails to build or load is a fault, which
    `unavailable_reason()` reports and callers (and tests) must not take for a missing feature."""
    try:
        forced = _forced_path()
        wanted = _path_named(path) if path else forced or FLOOR
    except _Unavailable as exc:
        return str(exc)
    problem = _disabled_reason()
    if problem is None and (problem := _platform_problem(wanted)) and wanted is not FLOOR:
        problem = f"{f'KVGATE_CPU_ISA={wanted.name}' if wanted is forced else f'the {wanted.name} path'}: {problem}"
    if problem or not int4:
        return problem
    missing = [f for f in INT4_CPU_FLAGS if f not in _cpu_flags()]
    return f"the CPU lacks {', '.join(missing)} (the int4 kernel)" if missing else None


def _disabled_reason() -> str | None:
    if os.environ.get("KVGATE_CPU_KERNELS", "1").strip().lower() in ("0", "false", "no", "off"):
        return "disabled by KVGATE_CPU_KERNELS"
    return None


def _path_named(name: str) -> KernelPath:
    for p in PATHS:
        if p.name == name:
            return p
    raise _Unavailable(f"no kernel path {name!r} (one of {', '.join(p.name for p in PATHS)})")


def _forced_path() -> KernelPath | None:
    """The path KVGATE_CPU_ISA forces, or None (unset or "auto": the best this CPU runs)."""
    name = os.environ.get("KVGATE_CPU_ISA", "auto").strip().lower()
    if name in ("", "auto"):
        return None
    try:
        return _path_named(name)
    except _Unavailable as exc:
        raise _Unavailable(f"KVGATE_CPU_ISA={name}: {exc}") from None


def load() -> ctypes.CDLL | None:
    """The chosen path's kernel library, building it if needed; None when none can be had here
    (logged once)."""
    return _loaded()[0]


def available() -> bool:
    return load() is not None


def unavailable_reason() -> str | None:
    return _loaded()[2]


def path() -> KernelPath | None:
    """The kernel path that runs (`AVX512`, `AVX2`), or None: no kernels here."""
    return _loaded()[1]


def path_label() -> str:
    """What the start-up line and /v1/models say: "avx512 (AVX-512 F/BW/VL/DQ)"."""
    chosen = path()
    return f"{chosen.name} ({chosen.summary})" if chosen else "none"


def reset_choice() -> None:
    """Forget the chosen path, so that the next call chooses again from the environment (tests and
    benchmarks run both paths in one process; each path's library stays loaded)."""
    _loaded.cache_clear()


@functools.cache
def _loaded() -> tuple[ctypes.CDLL | None, KernelPath | None, str | None]:
    try:
        lib, chosen = _choose()
        return lib, chosen, None
    except _Unavailable as exc:
        log.warning("CPU kernels unavailable (%s): using the torch paths", exc)
        return None, None, str(exc)


def _choose() -> tuple[ctypes.CDLL, KernelPath]:
    """The forced path, or the best one this CPU runs whose library builds and loads (a path that
    does not is logged and passed over; the floor's failure is the kernels' failure)."""
    problem = _disabled_reason()
    forced = _forced_path()
    if problem:
        raise _Unavailable(problem)
    if forced is not None:
        problem = _platform_problem(forced)
        if problem:
            raise _Unavailable(f"KVGATE_CPU_ISA={forced.name}: {problem}")
        return _library(forced), forced
    runnable = [p for p in PATHS if _platform_problem(p) is None]
    if not runnable:
        raise _Unavailable(_platform_problem(FLOOR))
    passed_over = []  # why the better paths were not taken: part of the reason if the floor fails too
    for candidate in runnable[:-1]:
        try:
            return _library(candidate), candidate
        except _Unavailable as exc:
            log.warning("the %s kernels are unavailable (%s): using the %s path", candidate.name, exc,
                        runnable[-1].name)
            passed_over.append(f"{candidate.name}: {exc}")
    try:
        return _library(runnable[-1]), runnable[-1]
    except _Unavailable as exc:
        raise _Unavailable("; ".join([*passed_over, f"{runnable[-1].name}: {exc}"])) from None


@functools.cache
def _library(kernel_path: KernelPath) -> ctypes.CDLL:
    """One path's library, loaded once per process (a failure is not cached: raised each time)."""
    return _load(kernel_path)


class _Unavailable(Exception):
    pass


class _NotAsBuilt(_Unavailable):
    """The library's bytes are not those its build recorded (swapped, damaged, or copied in
    without its record): rebuilt where a compiler can, refused otherwise."""


def _load(kernel_path: KernelPath) -> ctypes.CDLL:
    path = _built_library(kernel_path)
    try:
        return _open_verified(path)
    except _NotAsBuilt as changed:
        log.warning("%s: rebuilding it", changed)
        try:
            _build(path, kernel_path)
        except _Unavailable as failed:
            raise _Unavailable(f"refusing to load {changed}; rebuilding it failed: {failed}") from None
        return _open_verified(path)


def _open_verified(path: Path) -> ctypes.CDLL:
    """Load the library through a descriptor held from the checks to the load: what is checked
    (owners and modes of the file and its folders, the bytes against the build's record) is the
    very file loaded, whatever is renamed over its path meanwhile. The descriptor of a loaded
    library stays open: the loader knows a library by the name it was opened under, so a second
    path's library opened through a reused /proc/self/fd/N would be taken for the first."""
    try:
        fd = os.open(os.path.realpath(path), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise _Unavailable(f"cannot open {path}: {exc.strerror}") from None
    try:
        problem = untrusted_reason(path, os.fstat(fd))
        if problem:
            raise _Unavailable(f"refusing to load {path}: {problem}")
        _check_as_built(path, fd)
        try:
            lib = ctypes.CDLL(f"/proc/self/fd/{fd}")
            for name, (argtypes, restype) in _SIGNATURES.items():
                fn = getattr(lib, name)
                fn.argtypes, fn.restype = argtypes, restype
        except (OSError, AttributeError) as exc:  # a damaged file in the cache
            raise _Unavailable(f"cannot load {path}: {exc}") from None
    except BaseException:
        os.close(fd)
        raise
    lib._name = str(path)  # its repr and messages name the file, not the descriptor it came through
    return lib


def record_path(library: Path) -> Path:
    """The build's record of the library's sha256, beside it."""
    return library.with_name(library.name + ".sha256")


def _check_as_built(path: Path, fd: int) -> None:
    try:
        recorded = record_path(path).read_text().strip()
    except FileNotFoundError:
        raise _NotAsBuilt(f"{path}: no record of its build ({record_path(path).name})") from None
    except OSError as exc:
        raise _Unavailable(f"cannot read {record_path(path)}: {exc.strerror}") from None
    problem = untrusted_reason(record_path(path))  # who can rewrite the record can vouch for any library
    if problem:
        raise _Unavailable(f"refusing to load {path}: {problem}")
    found = _sha256(fd)
    if found != recorded:
        raise _NotAsBuilt(f"{path}: its bytes changed since it was built (sha256 {found[:16]}, "
                          f"recorded {recorded[:16]})")


def _sha256(fd: int) -> str:
    digest, offset = hashlib.sha256(), 0
    while chunk := os.pread(fd, 1 << 20, offset):
        digest.update(chunk)
        offset += len(chunk)
    return digest.hexdigest()


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if not cc:
        raise _Unavailable("no C compiler (gcc or cc) on PATH")
    return cc


def _cflags(kernel_path: KernelPath) -> list[str]:
    return [*CFLAGS, *kernel_path.cflags]


def library_path(kernel_path: KernelPath = FLOOR) -> Path:
    """Where the library of `kernel_path` for this source and these flags lives, built or not:
    `KVGATE_KERNELS_DIR` if set (a container image builds it there in its build stage, for a
    runtime without a compiler), else `kernels/` in the kvgate cache."""
    digest = hashlib.sha256(" ".join(_cflags(kernel_path)).encode())
    for source in (*SOURCES, *HEADERS):
        digest.update(source.read_bytes())
    key = digest.hexdigest()[:16]
    folder = os.environ.get("KVGATE_KERNELS_DIR")
    if not folder:
        folder = kvgate_cache_dir() / "kernels"
    return Path(folder) / f"cpu_kernels-{kernel_path.name}-{key}.so"


def _built_library(kernel_path: KernelPath) -> Path:
    target = library_path(kernel_path)
    if not target.exists():
        _build(target, kernel_path)
    return target


def _build(target: Path, kernel_path: KernelPath) -> None:
    """Compile into a temporary file, record its sha256, then rename it over `target`."""
    cc = _compiler()
    try:
        target.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
    except OSError as exc:
        raise _Unavailable(f"cannot write to {target.parent}: {exc}") from None
    os.close(fd)
    try:
        try:
            done = subprocess.run([cc, *_cflags(kernel_path), *map(str, SOURCES), "-o", tmp, "-lm"],
                                  capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.SubprocessError) as exc:
            raise _Unavailable(f"{cc} does not run: {exc}") from None
        if done.returncode != 0:
            raise _Unavailable(f"{cc} failed: {done.stderr.strip()[-2000:]}")
        os.chmod(tmp, 0o755)  # whatever the umask: readable by all, writable by its owner only
        _write_record(tmp, record_path(target))
        os.replace(tmp, target)  # atomic: another process sees the whole file or none
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    log.info("built the %s CPU kernels: %s", kernel_path.name, target)


def _write_record(library: str, record: Path) -> None:
    fd = os.open(library, os.O_RDONLY)
    try:
        text = _sha256(fd) + "\n"
    finally:
        os.close(fd)
    tmp = record.with_name(f"{record.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.chmod(tmp, 0o644)
    os.replace(tmp, record)


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
    """One query per row, attending its sequence's first row_keys[r] cached positions. The values of
    row_seq, row_keys and the block tables are trusted (the runner checks every block table
    against its context length); their types and layouts are checked here."""
    _check(q, cache_k, cache_v, dtype=torch.float32)
    _check(block_tables, row_seq, row_keys, dtype=torch.int64)
    if not (cache_k.is_contiguous() and cache_v.is_contiguous() and block_tables.stride(1) == 1):
        raise ValueError("paged_decode needs contiguous caches and block-table rows")
    if row_seq.numel() != q.shape[0] or row_keys.numel() != q.shape[0]:
        raise ValueError("paged_decode: one row_seq and row_keys entry per query row")
    q = q.contiguous()
    row_seq, row_keys = row_seq.contiguous(), row_keys.contiguous()
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


class _KV(ctypes.Structure):
    """kernels.h's kvg_kv: a quantized layer's K/V and what decodes it."""

    _fields_ = [("cache_k", _ptr), ("cache_v", _ptr), ("k_scales", _ptr), ("v_scales", _ptr), ("lut", _ptr),
                ("k_scale", _f32), ("v_scale", _f32), ("fmt", _i64), ("clamped", _ptr)]


@dataclasses.dataclass
class QuantizedKV:
    """What the quantized kernels read of a layer (kv_cache.KVLayer's fields, as tensors)."""

    key: torch.Tensor  # (num_blocks, block_size, kv_heads, head_dim), 1-byte elements, contiguous
    value: torch.Tensor
    fmt: int  # KVCacheDType.code: 1 fp8_e4m3, 2 fp8_e5m2, 3 int8
    k_scale: float = 1.0  # fp8
    v_scale: float = 1.0
    key_scales: torch.Tensor | None = None  # int8: (num_blocks, block_size, kv_heads) float32
    value_scales: torch.Tensor | None = None
    lut: torch.Tensor | None = None  # fp8: (256,) float32
    clamped: torch.Tensor | None = None  # fp8: (2, kv_heads) int64 clamp counters (K, V), added to; None: not counted

    def check(self) -> None:
        if self.fmt not in (1, 2, 3) or self.key.element_size() != 1 or self.value.shape != self.key.shape:
            raise ValueError("quantized KV: 1-byte key and value caches alike and a format code of 1, 2 or 3")
        if not (self.key.is_contiguous() and self.value.is_contiguous()) or self.key.device.type != "cpu":
            raise ValueError("quantized KV: contiguous caches on the CPU expected")
        extra = (self.key_scales, self.value_scales) if self.fmt == 3 else (self.lut,)
        if any(t is None for t in extra):
            raise ValueError("quantized KV: int8 needs its row scales, fp8 its lookup table")
        _check(*extra, dtype=torch.float32)
        if self.fmt == 3 and not (self.key_scales.shape == self.key.shape[:3] == self.value_scales.shape):
            raise ValueError("quantized KV: int8 scales must be (num_blocks, block_size, kv_heads)")
        if self.fmt != 3 and self.lut.numel() != 256:
            raise ValueError("quantized KV: the fp8 table has 256 entries")
        if self.clamped is not None and (self.clamped.dtype != torch.int64 or self.clamped.device.type != "cpu"
                                         or self.clamped.shape != (2, self.key.shape[2])
                                         or not self.clamped.is_contiguous()):
            raise ValueError("quantized KV: clamp counters are a contiguous (2, kv_heads) int64 tensor")

    def struct(self) -> _KV:
        ptr = lambda t: t.data_ptr() if t is not None else None  # noqa: E731
        return _KV(ptr(self.key), ptr(self.value), ptr(self.key_scales), ptr(self.value_scales), ptr(self.lut),
                   self.k_scale, self.v_scale, self.fmt, ptr(self.clamped))


def paged_decode_q(q: torch.Tensor, kv: QuantizedKV, block_tables: torch.Tensor, row_seq: torch.Tensor,
                   row_keys: torch.Tensor, scale: float, chunk_blocks: int | None = None) -> torch.Tensor:
    """`paged_decode` over a quantized cache: dequantized inside the kernel's loops."""
    kv.check()
    _check(q, dtype=torch.float32)
    _check(block_tables, row_seq, row_keys, dtype=torch.int64)
    if block_tables.stride(1) != 1 or row_seq.numel() != q.shape[0] or row_keys.numel() != q.shape[0]:
        raise ValueError("paged_decode_q: block-table rows contiguous, one row_seq and row_keys entry per row")
    q, row_seq, row_keys = q.contiguous(), row_seq.contiguous(), row_keys.contiguous()
    out = torch.empty_like(q)
    num_rows, num_heads, head_dim = q.shape
    _, block_size, kv_heads, _ = kv.key.shape
    rc = load().kvgate_paged_decode_q(
        out.data_ptr(), q.data_ptr(), ctypes.byref(kv.struct()), block_tables.data_ptr(), block_tables.stride(0),
        row_seq.data_ptr(), row_keys.data_ptr(), num_rows, num_heads, kv_heads, head_dim, block_size, scale,
        chunk_blocks or default_chunk_blocks(row_keys, block_size))
    if rc != 0:
        raise RuntimeError(f"kvgate_paged_decode_q failed ({rc})")
    return out


def write_kv_q(k: torch.Tensor, v: torch.Tensor, kv: QuantizedKV, slot_mapping: torch.Tensor) -> None:
    """Quantize each new token's K and V into its slot (attention/kv_quant.py's rules, bit for bit)."""
    kv.check()
    _check(k, v, dtype=torch.float32)
    _check(slot_mapping, dtype=torch.int64)
    if k.shape[1:] != kv.key.shape[2:] or v.shape != k.shape or slot_mapping.numel() != k.shape[0]:
        raise ValueError("write_kv_q: k and v (n, kv_heads, head_dim) alike, one slot per token")
    k, v, slot_mapping = k.contiguous(), v.contiguous(), slot_mapping.contiguous()
    ptr = lambda t: t.data_ptr() if t is not None else None  # noqa: E731
    rc = load().kvgate_write_kv_q(kv.key.data_ptr(), kv.value.data_ptr(), ptr(kv.key_scales), ptr(kv.value_scales),
                                  k.data_ptr(), v.data_ptr(), slot_mapping.data_ptr(), k.shape[0], k.shape[1],
                                  k.shape[2], kv.fmt, kv.k_scale, kv.v_scale, ptr(kv.clamped))
    if rc != 0:
        raise RuntimeError(f"kvgate_write_kv_q failed ({rc})")


PREFILL_HEAD_DIMS = range(32, 257, 32)  # what the prefill kernel's register tiles take


def prefill_attention(
    q: torch.Tensor,  # (q_len, num_heads, head_dim) float32: the sequence's newest q_len positions
    cache_k: torch.Tensor,  # (num_blocks, block_size, kv_heads, head_dim) float32
    cache_v: torch.Tensor,
    block_ids: torch.Tensor,  # (>= cdiv(ctx, block_size),) int64: the sequence's block table
    ctx: int,  # cached + new positions; query i sits at ctx - q_len + i
    scale: float,
    *,
    bf16: bool = False,  # the products in bf16 (fp32 sums and softmax): where bf16_prefill_problem() is None
) -> torch.Tensor:  # (q_len, num_heads, head_dim)
    """Causal attention of one sequence's prompt chunk over its cached keys (bottom-right: a chunk
    after a cached prefix sees the prefix). The block ids' values are trusted (the runner checks
    every block table against its context length); types, shapes and layouts are checked here."""
    _check(q, cache_k, cache_v, dtype=torch.float32)
    _check(block_ids, dtype=torch.int64)
    q_len, num_heads, head_dim = q.shape
    _, block_size, kv_heads, _ = cache_k.shape
    if not (cache_k.is_contiguous() and cache_v.is_contiguous() and block_ids.is_contiguous()):
        raise ValueError("prefill_attention needs contiguous caches and block ids")
    if head_dim not in PREFILL_HEAD_DIMS or cache_k.shape[3] != head_dim or num_heads % kv_heads:
        raise ValueError(f"prefill_attention: head_dim {head_dim} (a multiple of 32 up to 256) and "
                         f"{num_heads} heads over {kv_heads} KV heads")
    if not 1 <= q_len <= ctx or block_ids.numel() * block_size < ctx:
        raise ValueError(f"prefill_attention: {q_len} queries, {ctx} positions, {block_ids.numel()} blocks")
    q = q.contiguous()
    out = torch.empty_like(q)
    name = "kvgate_prefill_attention_bf16" if bf16 else "kvgate_prefill_attention_f32"
    rc = getattr(load(), name)(out.data_ptr(), q.data_ptr(), cache_k.data_ptr(), cache_v.data_ptr(),
                               block_ids.data_ptr(), q_len, ctx, num_heads, kv_heads, head_dim, block_size, scale)
    if rc != 0:
        why = " (no AVX512_BF16 in this build or CPU)" if rc == -3 else ""
        raise RuntimeError(f"{name} failed ({rc}){why}")
    return out


BF16_PREFILL_CPU_FLAG = "avx512_bf16"  # /proc/cpuinfo's name for vdpbf16ps


def bf16_prefill_problem() -> str | None:
    """Why `prefill_attention(..., bf16=True)` cannot run here, or None: it needs the avx512 path's
    library (the AVX2 build has no bf16 kernel) on a CPU with AVX512_BF16."""
    if not available():
        return f"no C kernels ({unavailable_reason()})"
    if path() is not AVX512:
        return f"the {path().name} kernel path has no bf16 attention: it needs the avx512 path"
    if BF16_PREFILL_CPU_FLAG not in _cpu_flags():
        return "the CPU has no AVX512_BF16"
    return None


def readable(*tensors: torch.Tensor | None, dtype: torch.dtype) -> bool:
    """Whether the kernels can read every tensor (None: an absent bias) as a flat array: `dtype`,
    on the CPU, contiguous. For callers that fall back instead of raising like `_check`."""
    return all(t is None or (t.dtype == dtype and t.device.type == "cpu" and t.is_contiguous()) for t in tensors)


def _check(*tensors: torch.Tensor, dtype: torch.dtype) -> None:
    """The kernels read raw pointers: a wrong dtype or device would read the wrong memory."""
    for t in tensors:
        if t.dtype != dtype or t.device.type != "cpu":
            raise ValueError(f"CPU kernel argument: {dtype} on the CPU expected, got {t.dtype} on {t.device}")


def default_chunk_blocks(row_keys: torch.Tensor, block_size: int) -> int:
    """Blocks per work item of `paged_decode`: about 8 items per thread, so that a batch of one long
    sequence still keeps every thread busy, and at most 32 blocks (few merges for long rows)."""
    total_blocks = int(row_keys.sum()) // block_size + row_keys.numel()
    return max(2, min(32, total_blocks // (8 * torch.get_num_threads())))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for float32 x (M, K) with small M; weight (N, K) contiguous, K a multiple of 8."""
    _check(x, weight, *([bias] if bias is not None else []), dtype=torch.float32)
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1] or not weight.is_contiguous():
        raise ValueError(f"linear: x {tuple(x.shape)} and a contiguous weight (N, {x.shape[-1]}) expected")
    if bias is not None and (bias.shape != (weight.shape[0],) or not bias.is_contiguous()):
        raise ValueError("linear: bias must be a contiguous (N,) tensor")
    return linear_unchecked(x, weight, bias)


def linear_unchecked(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`linear` for callers that have checked dtypes and shapes already (KernelLinear, per call)."""
    x = x.contiguous()
    m, k = x.shape
    n = weight.shape[0]
    y = x.new_empty((m, n))
    rc = load().kvgate_linear_f32(y.data_ptr(), x.data_ptr(), weight.data_ptr(),
                                  bias.data_ptr() if bias is not None else None, m, k, n)
    if rc != 0:
        raise RuntimeError(f"kvgate_linear_f32 failed ({rc})")
    return y


def write_kv(
    k: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim) float32
    v: torch.Tensor,
    cache_k: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim) float32, contiguous
    cache_v: torch.Tensor,
    slot_mapping: torch.Tensor,  # (num_tokens,) int64, each < num_blocks * block_size
) -> None:
    """The reference's write_kv (each new token's K/V into its slot), both caches in one call."""
    _check(k, v, cache_k, cache_v, dtype=torch.float32)
    _check(slot_mapping, dtype=torch.int64)
    if not (cache_k.is_contiguous() and cache_v.is_contiguous()) or k.shape[1:] != cache_k.shape[2:]:
        raise ValueError("write_kv: contiguous caches whose rows match k and v expected")
    if slot_mapping.numel() != k.shape[0] or v.shape != k.shape:
        raise ValueError("write_kv: one slot per new token, k and v alike")
    k, v, slot_mapping = k.contiguous(), v.contiguous(), slot_mapping.contiguous()
    load().kvgate_write_kv_f32(cache_k.data_ptr(), cache_v.data_ptr(), k.data_ptr(), v.data_ptr(),
                               slot_mapping.data_ptr(), k.shape[0], k.shape[1] * k.shape[2])


def add_rms_norm_(
    residual: torch.Tensor,  # (M, D) float32, contiguous: gets `delta` added in place
    delta: torch.Tensor | None,  # (M, D) float32, or None: only the norm
    weight: torch.Tensor,  # (D,) float32
    eps: float,
) -> torch.Tensor:  # (M, D): rms_norm(residual) * weight, a new tensor
    """residual += delta; return F.rms_norm(residual, (D,), weight, eps), in one pass per row."""
    tensors = (residual, weight) if delta is None else (residual, delta, weight)
    _check(*tensors, dtype=torch.float32)
    d = residual.shape[-1]
    if not residual.is_contiguous() or residual.dim() != 2 or weight.shape != (d,) or d % 8 != 0:
        raise ValueError("add_rms_norm_: a contiguous (M, D) residual with D a multiple of 8 and a (D,) weight")
    if delta is not None and delta.shape != residual.shape:
        raise ValueError(f"add_rms_norm_: delta {tuple(delta.shape)} does not match {tuple(residual.shape)}")
    delta = delta.contiguous() if delta is not None else None
    weight = weight.contiguous()
    out = torch.empty_like(residual)
    load().kvgate_add_rms_norm_f32(residual.data_ptr(), delta.data_ptr() if delta is not None else None,
                                   weight.data_ptr(), out.data_ptr(), residual.shape[0], d, eps)
    return out


def rope_qk_(
    q: torch.Tensor,  # (n, q_heads, D) float32, contiguous: rotated in place
    k: torch.Tensor,  # (n, k_heads, D) float32, contiguous: rotated in place
    positions: torch.Tensor,  # (n,) int64, each < cos.shape[0]
    cos: torch.Tensor,  # (max_positions, D // 2) float32: cos(p * inv_freq)
    sin: torch.Tensor,  # (max_positions, D // 2) float32
) -> None:
    """Rotary embedding of q and k in place, pairs (i, i + D/2) as Hugging Face's rotate_half."""
    _check(q, k, cos, sin, dtype=torch.float32)
    _check(positions, dtype=torch.int64)
    n, _, d = q.shape
    if not (q.is_contiguous() and k.is_contiguous() and cos.is_contiguous() and sin.is_contiguous()):
        raise ValueError("rope_qk_: contiguous q, k and tables expected")
    if k.dim() != 3 or k.shape[0] != n or k.shape[2] != d or d % 16 != 0 or cos.shape != (cos.shape[0], d // 2):
        raise ValueError("rope_qk_: q (n, Hq, D), k (n, Hk, D) and (P, D/2) tables, D a multiple of 16")
    if positions.shape != (n,) or sin.shape != cos.shape:
        raise ValueError("rope_qk_: one position per token, cos and sin alike")
    positions = positions.contiguous()
    load().kvgate_rope_qk_f32(q.data_ptr(), k.data_ptr(), positions.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                              n, q.shape[1], k.shape[1], d)


def silu_mul_(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up written into gate (both (M, N) float32, contiguous, N a multiple of 8)."""
    _check(gate, up, dtype=torch.float32)
    if not (gate.is_contiguous() and up.is_contiguous()) or gate.shape != up.shape or gate.dim() != 2 \
            or gate.shape[1] % 8 != 0:
        raise ValueError("silu_mul_: contiguous (M, N) gate and up alike, N a multiple of 8")
    load().kvgate_silu_mul_f32(gate.data_ptr(), gate.data_ptr(), up.data_ptr(), gate.shape[0], gate.shape[1])
    return gate


def int4_available() -> bool:
    """Whether the int4 kernel runs here: the library loads and the CPU has F16C besides AVX2/FMA."""
    lib = load()
    return lib is not None and lib.kvgate_int4_supported() == 1


def int4_linear(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, K) float32 @ the AutoAWQ GEMM weight (quantization/format.py) + bias -> (M, N) float32."""
    _check(x, *([bias] if bias is not None else []), dtype=torch.float32)
    _check(qweight, qzeros, dtype=torch.int32)
    _check(scales, dtype=torch.float16)
    k, n = qweight.shape[0], qweight.shape[1] * 8
    groups = scales.shape[0]
    if x.dim() != 2 or x.shape[1] != k or groups < 1 or k % groups or scales.shape != (groups, n) \
            or qzeros.shape != (groups, n // 8):
        raise ValueError(f"int4_linear: x {tuple(x.shape)}, qweight {tuple(qweight.shape)}, "
                         f"qzeros {tuple(qzeros.shape)}, scales {tuple(scales.shape)} do not fit together")
    if not (qweight.is_contiguous() and qzeros.is_contiguous() and scales.is_contiguous()) or \
            (bias is not None and (bias.shape != (n,) or not bias.is_contiguous())):
        raise ValueError("int4_linear: contiguous qweight, qzeros, scales and an (N,) bias expected")
    return int4_linear_unchecked(x, qweight, qzeros, scales, bias)


def int4_linear_unchecked(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                          bias: torch.Tensor | None) -> torch.Tensor:
    """`int4_linear` for callers that checked types and shapes once (the AWQ linear method)."""
    return _int4_call("kvgate_int4_linear_f32", x, qweight, qzeros, scales, bias)


def int4_linear_off(x: torch.Tensor, qweight: torch.Tensor, offsets: torch.Tensor, scales: torch.Tensor,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """`int4_linear` of the offset variant: W[k, n] = q * s + o per group, offsets (K/G, N) fp16
    in place of qzeros (quantization/gguf_int4.py: GGUF's Q4_0 / Q4_1 blocks)."""
    _check(x, *([bias] if bias is not None else []), dtype=torch.float32)
    _check(qweight, dtype=torch.int32)
    _check(offsets, scales, dtype=torch.float16)
    k, n = qweight.shape[0], qweight.shape[1] * 8
    groups = scales.shape[0]
    if x.dim() != 2 or x.shape[1] != k or groups < 1 or k % groups or scales.shape != (groups, n) \
            or offsets.shape != scales.shape:
        raise ValueError(f"int4_linear_off: x {tuple(x.shape)}, qweight {tuple(qweight.shape)}, "
                         f"offsets {tuple(offsets.shape)}, scales {tuple(scales.shape)} do not fit together")
    if not (qweight.is_contiguous() and offsets.is_contiguous() and scales.is_contiguous()) or \
            (bias is not None and (bias.shape != (n,) or not bias.is_contiguous())):
        raise ValueError("int4_linear_off: contiguous qweight, offsets, scales and an (N,) bias expected")
    return int4_linear_off_unchecked(x, qweight, offsets, scales, bias)


def int4_linear_off_unchecked(x: torch.Tensor, qweight: torch.Tensor, offsets: torch.Tensor, scales: torch.Tensor,
                              bias: torch.Tensor | None) -> torch.Tensor:
    return _int4_call("kvgate_int4_linear_off_f32", x, qweight, offsets, scales, bias)


def _int4_call(name: str, x: torch.Tensor, qweight: torch.Tensor, per_group: torch.Tensor, scales: torch.Tensor,
               bias: torch.Tensor | None) -> torch.Tensor:
    """One of the int4 kernels: per_group is qzeros (kvgate_int4_linear_f32) or offsets (_off_f32)."""
    x = x.contiguous()
    m, k = x.shape
    n = scales.shape[1]
    y = x.new_empty((m, n))
    rc = getattr(load(), name)(y.data_ptr(), x.data_ptr(), qweight.data_ptr(), per_group.data_ptr(),
                               scales.data_ptr(), bias.data_ptr() if bias is not None else None,
                               m, k, n, k // scales.shape[0])
    if rc != 0:
        raise RuntimeError(f"{name} failed ({rc})")
    return y


def int8_rows(x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x (M, K) float32 @ (w8 (N, K) int8 * scale (N,) float32)^T -> (M, N) float32; K a multiple of 8."""
    _check(x, scale, dtype=torch.float32)
    _check(w8, dtype=torch.int8)
    if x.dim() != 2 or w8.dim() != 2 or x.shape[1] != w8.shape[1] or scale.shape != (w8.shape[0],) \
            or w8.shape[1] % 8 or not (w8.is_contiguous() and scale.is_contiguous()):
        raise ValueError(f"int8_rows: x {tuple(x.shape)}, w8 {tuple(w8.shape)}, scale {tuple(scale.shape)}")
    x = x.contiguous()
    y = x.new_empty((x.shape[0], w8.shape[0]))
    rc = load().kvgate_int8_rows_f32(y.data_ptr(), x.data_ptr(), w8.data_ptr(), scale.data_ptr(), x.shape[0],
                                     x.shape[1], w8.shape[0])
    if rc != 0:
        raise RuntimeError(f"kvgate_int8_rows_f32 failed ({rc})")
    return y


def build_all() -> list[Path]:
    """Every path's library, built where missing, whatever this CPU runs (compiling needs only the
    compiler): a container's build stage, for the CPU that will run the image. A path that does
    not build is logged and left out; the floor's failure raises."""
    built = []
    for kernel_path in PATHS:
        try:
            built.append(_built_library(kernel_path))
        except _Unavailable as exc:
            if kernel_path is FLOOR:
                raise
            log.warning("the %s kernels do not build here (%s): left out", kernel_path.name, exc)
    return built


if __name__ == "__main__":  # build ahead of time (a container's build stage): prints the files
    import sys

    logging.basicConfig(level=logging.INFO)
    try:
        for library in build_all():
            print(library)
    except _Unavailable as exc:
        sys.exit(f"CPU kernels unavailable: {exc}")
