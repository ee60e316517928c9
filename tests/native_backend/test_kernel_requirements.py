"""A kernel test skips only where the CPU cannot run the kernels (tests/support/checks/c_kernels.py): a library
that fails to build is a failure, and KVGATE_REQUIRE_KERNELS turns even a CPU-based skip into
one. Each case runs a one-test pytest session in a child process with a fresh kernel folder."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.checks import cpu_flags
from tests.support.checks.skips import required

ROOT = Path(__file__).resolve().parents[2]
PROBE = '''
import pytest

@pytest.mark.usefixtures("int4_kernel")
def test_int4():
    pass
'''


def outcome(tmp_path, **env) -> tuple[str, str]:
    (tmp_path / "test_probe.py").write_text(PROBE)
    kernels = tmp_path / "kernels"
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("KVGATE_REQUIRE_", "KVGATE_CPU_KERNELS"))}
    environ.update(PYTHONPATH=str(ROOT), KVGATE_KERNELS_DIR=str(kernels), **env)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rfs", "-p", "tests.support.checks.skips", "-p", "tests.support.checks.c_kernels",
                           "-p", "no:cacheprovider", "--rootdir", str(tmp_path), str(tmp_path / "test_probe.py")],
                          cwd=tmp_path, env=environ, capture_output=True, text=True, timeout=600)
    last = proc.stdout.strip().splitlines()[-1]
    return last, proc.stdout


def test_a_compiler_that_fails_is_a_failure_not_a_skip(tmp_path):
    if missing := cpu_flags.missing(cpu_flags.AVX2_FLOOR + cpu_flags.INT4):  # the test's own read of the flags
        required("KVGATE_REQUIRE_KERNELS", f"/proc/cpuinfo lacks {', '.join(missing)}")
    last, out = outcome(tmp_path, CC="false")  # /bin/false: every build fails
    assert "1 error" in last, out  # failed in its fixture: an error, not a skip
    assert "the C kernel library is unusable on a machine that supports it: " in out, out
    # the reason names every path this CPU runs and why each was passed over, the floor last
    runnable = ["avx512"] * cpu_flags.has(cpu_flags.AVX512) + ["avx2"]  # by the test's own read of the flags
    reasons = " ".join(out.split())  # pytest wraps long lines
    assert re.search(".*".join(f"{name}: false failed" for name in runnable), reasons), out


def test_a_cpu_that_cannot_run_them_skips_unless_they_are_required(tmp_path):
    last, out = outcome(tmp_path, KVGATE_CPU_KERNELS="0")  # as a CPU without the instructions
    assert "1 skipped" in last and "the C kernels do not run here: disabled by KVGATE_CPU_KERNELS" in out, out
    last, out = outcome(tmp_path, KVGATE_CPU_KERNELS="0", KVGATE_REQUIRE_KERNELS="1")
    assert "1 error" in last and "required here: KVGATE_REQUIRE_KERNELS is set" in out, out


def test_where_the_kernels_build_the_probe_passes(tmp_path):
    if missing := cpu_flags.missing(cpu_flags.AVX2_FLOOR + cpu_flags.INT4):  # the test's own read of the flags
        required("KVGATE_REQUIRE_KERNELS", f"/proc/cpuinfo lacks {', '.join(missing)}")
    last, out = outcome(tmp_path, KVGATE_REQUIRE_KERNELS="1")
    assert "1 passed" in last, out
