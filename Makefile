# The README's commands: `make demo` (the main job), `make test` (everything) and
# `make test-quick` (all but the tests marked slow). Each sets itself up from nothing:
# a virtualenv with pinned installs. None of them installs anything outside .venv.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-quick lint venv clean

$(STAMP): requirements-ci.txt pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q pip==26.3 setuptools==84.2.1 wheel==0.48.0
	$(PY) -m pip install -q -r requirements-ci.txt
	MPZERO_BUILD_CUDA=0 $(PY) -m pip install -q --no-build-isolation --no-deps -e .
	touch $(STAMP)

venv: $(STAMP)

# The tiny GPT on CPU: 2 gloo ranks, ZeRO-2 over both, grad accumulation; the corpus
# (Python stdlib, tokenized once into ~/.cache/mpzero) is prepared on the first run.
DEMO_OUT ?= runs/demo
demo: $(STAMP)
	$(PY) -m mpzero.info
	rm -rf $(DEMO_OUT)
	OMP_NUM_THREADS=1 RAYON_NUM_THREADS=2 $(VENV)/bin/torchrun --standalone --nproc-per-node 2 \
	  -m examples.gpt.train --cpu --num-layers 4 --hidden-size 128 \
	  --num-attention-heads 4 --seq-length 64 --micro-batch-size 8 --global-batch-size 32 \
	  --train-iters 300 --lr 2e-3 --min-lr 2e-4 --lr-warmup-iters 30 --clip-grad 1.0 \
	  --log-interval 10 --eval-interval 100 --eval-iters 4 --save-interval 300 \
	  --save $(DEMO_OUT)/checkpoints --log-file $(DEMO_OUT)/log.jsonl
	$(PY) -m examples.gpt.plot_log $(DEMO_OUT)/log.jsonl --output $(DEMO_OUT)/curves.png \
	  --title "tiny GPT, 2 CPU ranks, ZeRO-2"

# One line per test as it ends (-v), the slowest at the end (--durations). Tests run on
# PYTEST_WORKERS pytest-xdist workers: a test's ranks wait on each other, so one worker
# leaves a 2-core machine part idle (three measured slower than two there).
PYTEST_WORKERS ?= 2
PYTEST_SHOW := -v --durations=25 --durations-min=2 -n $(PYTEST_WORKERS)

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_SHOW) --timeout 600 $(PYTEST_ARGS)

# Everything but @pytest.mark.slow (world-8 runs, multi-rank torchrun jobs, SLURM, the
# full parameter grids whose representatives stay quick, baselines, benchmark smoke runs).
test-quick: $(STAMP)
	$(PY) -m pytest $(PYTEST_SHOW) --timeout 300 -m "not slow" $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info
