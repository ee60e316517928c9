"""The tests' own read of the CPU's /proc/cpuinfo flags, independent of the engine's detection
(native_backend.kernels.cpu_kernels): which kernel path and which bf16 kernels a test expects to
run comes from here, so a detection that breaks (a misspelt flag, a wrong list) fails the tests
that check it instead of turning them into skips.

A test that needs a feature this CPU lacks skips through `need`, which fails instead where CI's
variable for it is set: .ci/run sets KVGATE_REQUIRE_AVX512 and KVGATE_REQUIRE_BF16_ATTENTION after
its own grep of /proc/cpuinfo finds the flags.
"""

from __future__ import annotations

import functools
import os
import platform

from tests.support.checks.skips import required

# The flags each feature needs, spelt as Linux prints them (arch/x86/include/asm/cpufeatures.h).
AVX2_FLOOR = ("avx2", "fma")  # the kernels' floor (f16c besides for the int4 kernel)
INT4 = ("f16c",)
AVX512 = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq")  # F/BW/VL/DQ
BF16_ATTENTION = (*AVX512, "avx512_bf16")  # vdpbf16ps, on the avx512 path
REQUIRE = {AVX512: "KVGATE_REQUIRE_AVX512", BF16_ATTENTION: "KVGATE_REQUIRE_BF16_ATTENTION"}


@functools.cache
def flags() -> frozenset[str]:
    """The first processor's flags; empty off x86-64 or without /proc/cpuinfo."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return frozenset()
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("flags")), "flags :")
    except OSError:
        return frozenset()
    return frozenset(line.split(":", 1)[1].split())


def has(features: tuple[str, ...]) -> bool:
    return all(flag in flags() for flag in features)


def missing(features: tuple[str, ...]) -> list[str]:
    return [flag for flag in features if flag not in flags()]


def kernels_off() -> bool:
    """KVGATE_CPU_KERNELS=0: the kernels are off by the user's word, whatever the CPU."""
    return os.environ.get("KVGATE_CPU_KERNELS", "1").strip().lower() in ("0", "false", "no", "off")


def need(features: tuple[str, ...]) -> None:
    """Skip unless this CPU shows every flag of `features` (a failure where CI requires them)."""
    if not has(features):
        required(REQUIRE[features], f"/proc/cpuinfo lacks {', '.join(missing(features))}")
