# PithTrain: `make train` runs the embedded default job, `make data` builds its dataset alone (data/stdlib),
# `make test` runs the whole test suite (what CI runs), `make test-fast` the fast tier (after each edit).
# Both set up .venv first (torch pinned to TORCH_VERSION, the CPU build on the CI machine).
# On a machine whose Python already has torch (the GPU image), run the same with PYTHONPATH=. instead.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0

.PHONY: setup data train test test-fast test-gpu clean

$(VENV)/.ready: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	@# torch is pinned first: an open range would pull a multi-GB CUDA build onto a CPU-only machine
	$(PY) -m pip install -q "torch==$(TORCH_VERSION)"
	$(PY) -m pip install -q -e ".[test,tensorboard,plot]"
	touch $@

setup: $(VENV)/.ready

# the quickstart's dataset alone: stdlib corpus -> byte-level BPE -> data/stdlib (+ its held-out eval.npy)
data: setup
	$(PY) examples/quickstart.py --data-only

train: setup
	$(PY) examples/quickstart.py

# two pytest-xdist workers, a test file each at a time (a file's module fixtures, such as
# tests/test_parallel.py's mesh runs, are built once), as much of the suite waits on one core for Python
# and torch to start in a subprocess; each worker runs one intra-op thread (tests/conftest.py). On 2 cores,
# cold: about 250 s
TEST_WORKERS ?= 2

test: setup
	$(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile tests

# the fast tier (tests marked `fast`, every module of pithtrain/ touched): run it after each edit
test-fast: setup
	$(PY) -m pytest -q -p no:cacheprovider -m fast tests

test-gpu: setup
	$(PY) -m pytest -q tests/gpu

# clean removes only what make made: the venv and the quickstart's outputs (runs/quickstart, and
# data/stdlib when it holds the quickstart's eval.npy), then runs/ and data/ if that left them empty.
# Never your own datasets or runs.
clean:
	rm -rf $(VENV) runs/quickstart
	if [ -f data/stdlib/eval.npy ]; then rm -rf data/stdlib; fi
	rmdir runs data 2>/dev/null || true
