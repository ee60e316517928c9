"""The C kernel library: the linear kernel against F.linear, and how the library is built, cached,
refused and loaded (in subprocesses where the process-wide load state or the environment matters)."""

from __future__ import annotations

import hashlib
import os
import stat
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from native_backend.kernels import cpu_kernels
from tests.support.checks import cpu_flags

torch.set_num_threads(2)
pytestmark = pytest.mark.usefixtures("c_kernels")  # skips only where the CPU cannot run them (tests/support/checks/c_kernels.py)
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 9, 12, 13, 15, 33, 128])
# 1536, 776, 2312: reduced in 2, 2 (392 + 384) and 4 slices of K
@pytest.mark.usefixtures("kernel_path")  # once per CPU kernel path (AVX2, AVX-512)
@pytest.mark.parametrize("k,n", [(8, 1), (576, 576), (576, 7), (64, 1538), (1536, 576), (776, 10), (2312, 9)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_matches_f_linear(m, k, n, with_bias):
    g = torch.Generator().manual_seed(m * 1000 + n)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    bias = torch.randn(n, generator=g) if with_bias else None
    torch.testing.assert_close(cpu_kernels.linear(x, w, bias), F.linear(x, w, bias), atol=1e-4, rtol=1e-5)


@pytest.mark.usefixtures("kernel_path")  # once per CPU kernel path (AVX2, AVX-512)
def test_linear_reads_a_non_contiguous_input():
    x = torch.randn(6, 1152)[:, ::2]  # (6, 576), stride 2
    w = torch.randn(40, 576)
    torch.testing.assert_close(cpu_kernels.linear(x, w), F.linear(x, w), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("args,match", [
    (lambda: (torch.randn(3, 16, dtype=torch.float64), torch.randn(5, 16)), "float32"),
    (lambda: (torch.randn(3, 16), torch.randn(16, 5).t()), "contiguous weight"),
    (lambda: (torch.randn(3, 16), torch.randn(5, 8)), "contiguous weight"),
    (lambda: (torch.randn(3, 16), torch.randn(5, 16), torch.randn(4)), "bias"),
])
def test_linear_refuses_what_it_cannot_read(args, match):
    with pytest.raises(ValueError, match=match):
        cpu_kernels.linear(*args())


def test_paged_decode_refuses_wrong_index_types():
    q, cache = torch.randn(2, 4, 8), torch.zeros(4, 4, 2, 8)
    tables, rows, keys = torch.zeros(2, 1, dtype=torch.long), torch.arange(2), torch.tensor([1, 2])
    with pytest.raises(ValueError, match="int64"):
        cpu_kernels.paged_decode(q, cache, cache, tables.int(), rows, keys, 1.0)
    with pytest.raises(ValueError, match="one row_seq"):
        cpu_kernels.paged_decode(q, cache, cache, tables, rows[:1], keys, 1.0)
    assert cpu_kernels.paged_decode(q, cache, cache, tables, rows, keys, 1.0).shape == q.shape


def _run(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": REPO_ROOT, **env}, timeout=240)


def test_built_once_into_the_cache_then_reused(tmp_path):
    code = """
        import torch
        from native_backend.kernels import cpu_kernels
        lib = cpu_kernels.load()
        assert lib is not None, cpu_kernels.unavailable_reason()
        print(lib._name)
    """
    first = _run(code, KVGATE_CACHE_DIR=str(tmp_path))
    assert first.returncode == 0, first.stderr
    path = first.stdout.strip()
    assert path.startswith(str(tmp_path / "kernels")) and os.path.exists(path)
    mtime = os.stat(path).st_mtime_ns
    second = _run(code, KVGATE_CACHE_DIR=str(tmp_path), CC="/nonexistent-compiler")  # needs no compiler now
    assert second.returncode == 0, second.stderr
    assert second.stdout.strip() == path and os.stat(path).st_mtime_ns == mtime
    assert not [p for p in os.listdir(tmp_path / "kernels") if p.endswith(".tmp")]


@pytest.mark.parametrize("env,reason", [
    ({"KVGATE_CPU_KERNELS": "0"}, "disabled by KVGATE_CPU_KERNELS"),
    ({"CC": "false"}, "false failed"),  # a compiler that fails: no library, the torch paths stay
    ({"KVGATE_KERNELS_DIR": "/proc/kvgate-kernels"}, "cannot write to /proc/kvgate-kernels"),
])
def test_unavailable_says_why_and_the_engine_keeps_torch(tmp_path, env, reason):
    env = {"KVGATE_CACHE_DIR": str(tmp_path), **env}
    done = _run("""
        import torch
        from native_backend.kernels import cpu_kernels
        from native_backend.model.attention import get_attention_backend
        assert cpu_kernels.load() is None
        print(cpu_kernels.unavailable_reason())
        print(get_attention_backend("cpu").name)
    """, **env)
    assert done.returncode == 0, done.stderr
    why, backend = done.stdout.strip().splitlines()
    assert reason in why and backend == "reference"
    assert "CPU kernels unavailable" in done.stderr  # logged once, as a warning


def test_the_library_shares_torchs_openmp_runtime():
    """Loaded after torch, the kernels bind to the libgomp torch brought: one thread pool."""
    done = _run("""
        import torch
        from native_backend.kernels import cpu_kernels
        assert cpu_kernels.load() is not None
        maps = {line.split()[-1] for line in open("/proc/self/maps") if "libgomp" in line}
        print(len(maps), *maps)
    """)
    assert done.returncode == 0, done.stderr
    count, *paths = done.stdout.split()
    assert count == "1" and "torch" in paths[0]


def test_prebuilt_ahead_of_time_into_a_kernels_dir(tmp_path):
    """A container's build stage runs `python -m native_backend.kernels.cpu_kernels`: it builds every
    path (the CPU that runs the image may not be the one that built it); the runtime, with no
    compiler, loads the one its CPU takes."""
    env = {"KVGATE_KERNELS_DIR": str(tmp_path / "kernels"), "KVGATE_CACHE_DIR": str(tmp_path / "cache")}
    built = subprocess.run([sys.executable, "-m", "native_backend.kernels.cpu_kernels"], capture_output=True, text=True,
                           cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": REPO_ROOT, **env}, timeout=240)
    assert built.returncode == 0, built.stderr
    paths = built.stdout.split()
    assert [os.path.basename(p).split("-")[1] for p in paths] == [p.name for p in cpu_kernels.PATHS]
    assert all(os.path.dirname(p) == str(tmp_path / "kernels") and os.path.exists(p) for p in paths)
    loaded = _run("""
        import torch
        from native_backend.kernels import cpu_kernels
        assert cpu_kernels.load() is not None, cpu_kernels.unavailable_reason()
        print(cpu_kernels.load()._name)
    """, CC="false", **env)
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.strip() in paths and not (tmp_path / "cache").exists()


def test_a_library_others_could_write_is_refused(tmp_path):
    """Loading a library runs it: one that another user could have replaced is not loaded."""
    kernels = tmp_path / "kernels"
    # One path: with the best one refused, the choice would fall back to the next (a library of its own).
    env = {"KVGATE_KERNELS_DIR": str(kernels), "KVGATE_CACHE_DIR": str(tmp_path / "cache"), "KVGATE_CPU_ISA": "avx2"}
    code = """
        import torch
        from native_backend.kernels import cpu_kernels
        print(cpu_kernels.load() is not None, cpu_kernels.unavailable_reason())
    """
    built = _run(code, **env)
    assert built.returncode == 0 and built.stdout.startswith("True"), built.stderr
    [library] = kernels.glob("*.so")
    assert stat.S_IMODE(library.stat().st_mode) == 0o755 and stat.S_IMODE(kernels.stat().st_mode) & 0o022 == 0

    library.chmod(0o777)  # the file writable by anyone
    refused = _run(code, **env)
    assert refused.stdout.startswith("False") and "is writable by others (mode 777)" in refused.stdout
    assert "refusing to load" in refused.stdout
    library.chmod(0o755)
    kernels.chmod(0o777)  # the folder: anyone could replace the file
    refused = _run(code, **env)
    assert refused.stdout.startswith("False") and f"{kernels} is writable by others" in refused.stdout
    kernels.chmod(0o1777)  # sticky, like /tmp: only the owner may replace its own file
    assert _run(code, **env).stdout.startswith("True")


LOAD_AND_SAY_WHY = """
    import torch
    from native_backend.kernels import cpu_kernels
    print(cpu_kernels.load() is not None, cpu_kernels.unavailable_reason())
"""


def test_a_library_under_a_folder_others_could_write_is_refused(tmp_path):
    """Any folder on the way counts, not only the library's own: whoever can rename a folder
    above it can put a library of their own at its path."""
    shared = tmp_path / "shared"
    env = {"KVGATE_KERNELS_DIR": str(shared / "team" / "kernels"), "KVGATE_CACHE_DIR": str(tmp_path / "cache")}
    assert _run(LOAD_AND_SAY_WHY, **env).stdout.startswith("True")
    shared.chmod(0o777)
    refused = _run(LOAD_AND_SAY_WHY, **env)
    assert refused.stdout.startswith("False") and f"{shared} is writable by others (mode 777)" in refused.stdout
    shared.chmod(0o1777)  # sticky, like /tmp: no one may rename another's entry
    assert _run(LOAD_AND_SAY_WHY, **env).stdout.startswith("True")


def test_a_library_changed_after_its_build_is_rebuilt_or_refused(tmp_path):
    """The build records the library's sha256: bytes that differ from it (swapped or damaged in
    place) are never loaded; with a compiler the library is rebuilt, without one it is refused."""
    kernels = tmp_path / "kernels"
    env = {"KVGATE_KERNELS_DIR": str(kernels), "KVGATE_CACHE_DIR": str(tmp_path / "cache")}
    assert _run(LOAD_AND_SAY_WHY, **env).stdout.startswith("True")
    [library] = kernels.glob("*.so")
    record = kernels / (library.name + ".sha256")
    built = library.read_bytes()
    assert record.read_text().split() == [hashlib.sha256(built).hexdigest()]

    library.write_bytes(built + b"\0")  # still a loadable library, but not the one built here
    refused = _run(LOAD_AND_SAY_WHY, CC="false", **env)
    assert refused.stdout.startswith("False"), refused.stdout
    assert "its bytes changed since it was built" in refused.stdout and "rebuilding it failed" in refused.stdout

    rebuilt = _run(LOAD_AND_SAY_WHY, **env)
    assert rebuilt.stdout.startswith("True") and "rebuilding it" in rebuilt.stderr
    assert record.read_text().split() == [hashlib.sha256(library.read_bytes()).hexdigest()]

    record.unlink()  # copied in without its record: nothing vouches for it
    refused = _run(LOAD_AND_SAY_WHY, CC="false", **env)
    assert refused.stdout.startswith("False") and "no record of its build" in refused.stdout


def test_the_best_path_the_cpu_runs_is_chosen_and_a_forced_one_loads_its_own_build(monkeypatch):
    # the best path by the test's own read of /proc/cpuinfo, not the engine's detection
    best = cpu_kernels.AVX512 if cpu_flags.has(cpu_flags.AVX512) else cpu_kernels.AVX2
    try:
        for forced, expected in (("auto", best), ("avx2", cpu_kernels.AVX2)):
            monkeypatch.setenv("KVGATE_CPU_ISA", forced)
            cpu_kernels.reset_choice()
            assert cpu_kernels.path() is expected and cpu_kernels.path_label().startswith(expected.name)
            assert cpu_kernels.load().kvgate_vector_bits() == (512 if expected is cpu_kernels.AVX512 else 256)
        monkeypatch.setenv("KVGATE_CPU_ISA", "avx9000")
        cpu_kernels.reset_choice()
        assert cpu_kernels.load() is None and cpu_kernels.path_label() == "none"
        assert cpu_kernels.unavailable_reason() == "KVGATE_CPU_ISA=avx9000: no kernel path 'avx9000' (one of avx512, avx2)"
        assert cpu_kernels.unsupported_reason() == cpu_kernels.unavailable_reason()  # a skip, not a fault
    finally:
        cpu_kernels.reset_choice()


def test_a_compiler_without_avx512_leaves_the_avx2_path(tmp_path):
    """Auto: the AVX-512 build fails (an old compiler), so the AVX2 floor runs, with a warning."""
    cpu_flags.need(cpu_flags.AVX512)
    cc = tmp_path / "cc"
    cc.write_text('#!/bin/sh\ncase "$*" in *-mavx512f*) echo "error: unrecognized option -mavx512f" >&2; exit 1;; '
                  'esac\nexec gcc "$@"\n')
    cc.chmod(0o755)
    done = _run("""
        import torch
        from native_backend.kernels import cpu_kernels
        print(cpu_kernels.path_label(), cpu_kernels.load().kvgate_vector_bits())
    """, CC=str(cc), KVGATE_CACHE_DIR=str(tmp_path / "cache"), KVGATE_CPU_ISA="auto")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "avx2 (AVX2 + FMA) 256"
    assert "the avx512 kernels are unavailable" in done.stderr and "unrecognized option -mavx512f" in done.stderr
