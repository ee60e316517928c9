# Helpers live in the tests.support package (servers, fakes, checks, data: tests/support/__init__.py);
# pytest puts the repository root on the path (pythonpath in pyproject.toml), so they import as
# tests.support.<kind>.<module>, from tests and from bench/ scripts alike.

# What every run reports about its skips, and what CI refuses to skip (tests/support/checks/skips.py); the C
# kernel tests' fixtures (tests/support/checks/c_kernels.py); the `scripted_upstream` fixture
# (tests/support/fakes/scripted_upstream.py).
pytest_plugins = ["tests.support.checks.skips", "tests.support.checks.c_kernels", "tests.support.fakes.scripted_upstream"]
