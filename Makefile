# The README's two commands: `make demo` (the main job) and `make test`.
# Each sets itself up from nothing: a virtualenv with pinned installs.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint venv clean

$(STAMP): requirements-ci.txt pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q -r requirements-ci.txt
	MPZERO_BUILD_CUDA=0 $(PY) -m pip install -q --no-build-isolation --no-deps -e .
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(PY) -m mpzero.info
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --standalone --nproc-per-node 2 examples/parallel_state_demo.py

test: $(STAMP)
	$(PY) -m pytest -q --timeout 600 $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info
