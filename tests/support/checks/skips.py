"""Skips that cannot hide a failure (a pytest plugin, loaded by tests/conftest.py).

- Every run ends with its skips counted by reason, so a reason that should not be there (a
  kernel that did not build, a server that was not installed) is seen, not buried in dots.
- With KVGATE_REQUIRE_SLOW set (.ci/run sets it), a test of the `slow` tier that skips fails
  instead: CI runs that tier to run it, and a skip there would be a green run that ran nothing.
- `required(variable, reason)` is the same rule for one dependency: a skip where the variable is
  unset, a failure where it is set (KVGATE_REQUIRE_LLAMACPP, KVGATE_REQUIRE_KERNELS, ...).
"""

from __future__ import annotations

import os
from collections import Counter

import pytest


def required(variable: str, reason: str):
    """Skip with `reason`, or fail with it where the environment sets `variable` (CI sets the
    ones its machine satisfies, so there a missing dependency is a failure)."""
    if os.environ.get(variable):
        pytest.fail(f"{reason} (required here: {variable} is set)", pytrace=False)
    pytest.skip(reason)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and os.environ.get("KVGATE_REQUIRE_SLOW") and item.get_closest_marker("slow"):
        report.outcome = "failed"
        report.longrepr = f"a slow-tier test skipped where KVGATE_REQUIRE_SLOW is set: {skip_reason(report)}"


def skip_reason(report) -> str:
    """The reason pytest recorded for a skip (its longrepr is (path, line, 'Skipped: reason'))."""
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


@pytest.hookimpl(trylast=True)  # after the durations and the short summary: the last thing read
def pytest_terminal_summary(terminalreporter):
    skipped = terminalreporter.stats.get("skipped", [])
    reasons = Counter(skip_reason(r) for r in skipped)
    terminalreporter.section(f"{len(skipped)} skipped, by reason")
    for reason, count in sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0])):
        terminalreporter.line(f"{count:5d}  {reason}")
