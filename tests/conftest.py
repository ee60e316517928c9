import os
import sys

# Tests import helpers from this folder (tests/servers.py).
sys.path.insert(0, os.path.dirname(__file__))

# What every run reports about its skips, and what CI refuses to skip (tests/skips.py); the C
# kernel tests' fixtures (tests/c_kernels.py); the `scripted_upstream` fixture (tests/scripted_upstream.py).
pytest_plugins = ["skips", "c_kernels", "scripted_upstream"]
