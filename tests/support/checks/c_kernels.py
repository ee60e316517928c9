"""Fixtures for tests of the C kernels (a pytest plugin, loaded by tests/conftest.py).

`c_kernels` / `int4_kernel` skip a test only where this machine cannot run the kernels (not
x86-64, a CPU without AVX2/FMA or, for int4, F16C, or KVGATE_CPU_KERNELS=0), and even then fail
where KVGATE_REQUIRE_KERNELS is set (CI's machine has the instructions). A library that fails to
build or load is never a skip: it fails the test, with the compiler's message.

`kernel_path` runs a test once per kernel path (the AVX2 floor and the AVX-512 build, forced
through KVGATE_CPU_ISA): the AVX2 one skips as `c_kernels` does, the AVX-512 one wherever the CPU
lacks its instructions (a machine without them runs the floor, which is all it would serve) by the
tests' own read of /proc/cpuinfo (tests.support.checks.cpu_flags), a failure where CI sets
KVGATE_REQUIRE_AVX512. Where that read shows the flags, the engine's detection saying otherwise is a
failure, never a skip.
"""

from __future__ import annotations

import os

import pytest

from tests.support.checks import cpu_flags
from tests.support.checks.skips import required


def _cpu_runs_them(int4: bool) -> bool:
    """Whether, by the tests' own read of /proc/cpuinfo, the kernels the environment asks for
    (KVGATE_CPU_ISA, else the floor) run on this CPU."""
    forced = os.environ.get("KVGATE_CPU_ISA", "auto").strip().lower()
    wanted = {"": cpu_flags.AVX2_FLOOR, "auto": cpu_flags.AVX2_FLOOR, "avx2": cpu_flags.AVX2_FLOOR,
              "avx512": cpu_flags.AVX512}.get(forced)
    needed = (wanted or ()) + (cpu_flags.INT4 if int4 else ())
    return not cpu_flags.kernels_off() and wanted is not None and cpu_flags.has(needed)


def need_kernels(int4: bool = False) -> None:
    from native_backend.kernels import cpu_kernels  # here: a session without kernel tests never imports torch

    reason = cpu_kernels.unsupported_reason(int4=int4)
    if reason and _cpu_runs_them(int4):  # the engine's detection is what is broken: no skip
        pytest.fail(f"the engine says the C kernels cannot run here ({reason}), but /proc/cpuinfo shows "
                    "the flags they need", pytrace=False)
    if reason:
        required("KVGATE_REQUIRE_KERNELS", f"the C kernels do not run here: {reason}")
    if not cpu_kernels.available():
        pytest.fail(f"the C kernel library is unusable on a machine that supports it: "
                    f"{cpu_kernels.unavailable_reason()}", pytrace=False)
    if int4 and not cpu_kernels.int4_available():
        pytest.fail("the library loads but its int4 kernel says the CPU cannot run it", pytrace=False)


KERNEL_PATHS = ("avx2", "avx512")  # cpu_kernels.PATHS' names (not imported here: no torch at collection)


@pytest.fixture(params=KERNEL_PATHS)
def kernel_path(request, monkeypatch):
    """The test runs with this path's library (KVGATE_CPU_ISA), chosen afresh before and after."""
    from native_backend.kernels import cpu_kernels

    monkeypatch.setenv("KVGATE_CPU_ISA", request.param)
    if request.param == "avx512" and cpu_flags.has(cpu_flags.AVX2_FLOOR):
        cpu_flags.need(cpu_flags.AVX512)  # the test's own read of the flags, not the engine's
    cpu_kernels.reset_choice()
    try:
        need_kernels()
        assert cpu_kernels.path().name == request.param
        yield request.param
    finally:
        cpu_kernels.reset_choice()


@pytest.fixture
def c_kernels():
    need_kernels()


@pytest.fixture
def int4_kernel():
    need_kernels(int4=True)
