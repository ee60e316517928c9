import os
import sys

# Tests import helpers from this folder (tests/servers.py).
sys.path.insert(0, os.path.dirname(__file__))
