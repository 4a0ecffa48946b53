# Two commands do all the set-up on a fresh machine:
#   make run    # the main job: an SPDF run end to end on the embedded default
#   make test   # the test suite (all of it: what CI runs), on every core (pytest-xdist)
#   make test-fast  # the inner loop: everything but the tests marked slow
VENV ?= .venv
# pytest-xdist workers (one per core); `make test WORKERS=0` runs in this process, one test at a time
WORKERS ?= auto
XDIST := -n $(WORKERS) --dist loadgroup
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test test-fast lint bench gpu-wheels gpu-check

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU build of torch first (a bare `torch` requirement can pull a multi-GB CUDA build).
	$(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/accelerate launch recipes/spdf.py --output_dir outputs/spdf --overwrite true

test: $(STAMP)
	$(PY) -m pytest -q $(XDIST) --durations=20

test-fast: $(STAMP)
	$(PY) -m pytest -q $(XDIST) -m "not slow"

lint: $(STAMP)
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

bench: $(STAMP)
	$(PY) benchmarks/overhead.py

# The GPU check (docs/gpu_check.md): `make gpu-wheels` where there is a network, then on the GPU machine
# `make gpu-check` (its own python: the machine's torch, no venv). On a CPU machine it is the dry run.
GPU_PYTHON ?= python3
GPU_REPORT ?= gpu_report

gpu-wheels:
	PYTHON=$(GPU_PYTHON) benchmarks/gpu/download_wheels.sh wheels

gpu-check:
	$(GPU_PYTHON) benchmarks/gpu_check.py $(GPU_REPORT)
