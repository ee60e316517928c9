"""Fixtures for tests of the C kernels (a pytest plugin, loaded by tests/conftest.py).

`c_kernels` / `int4_kernel` skip a test only where this machine cannot run the kernels (not
x86-64, a CPU without AVX2/FMA or, for int4, F16C, or KVGATE_CPU_KERNELS=0), and even then fail
where KVGATE_REQUIRE_KERNELS is set (CI's machine has the instructions). A library that fails to
build or load is never a skip: it fails the test, with the compiler's message.

`kernel_path` runs a test once per kernel path (the AVX2 floor and the AVX-512 build, forced
through KVGATE_CPU_ISA): the AVX2 one skips as `c_kernels` does, the AVX-512 one wherever the CPU
lacks its instructions (a machine without them runs the floor, which is all it would serve).
"""

from __future__ import annotations

import pytest

from tests.support.checks.skips import required


def need_kernels(int4: bool = False) -> None:
    from native_backend.kernels import cpu_kernels  # here: a session without kernel tests never imports torch

    reason = cpu_kernels.unsupported_reason(int4=int4)
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
    reason = cpu_kernels.unsupported_reason(path=request.param)
    if reason and request.param != cpu_kernels.FLOOR.name and not cpu_kernels.unsupported_reason(path="avx2"):
        pytest.skip(f"the {request.param} kernels do not run here: {reason}")
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
