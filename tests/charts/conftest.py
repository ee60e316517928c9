import os
import sys

# The chart tests import their helper (tools.py: helm and kubectl from PyPI) from this folder.
sys.path.insert(0, os.path.dirname(__file__))
