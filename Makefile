# make demo  — train a small GPT on 2 CPU processes (the built-in demo configuration)
# make test  — lint, the unit and gloo-distributed suites, then the emulated-CUDA tier
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install demo test test-fast test-emulated lint format clean

$(STAMP): pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# the CPU wheel; an unpinned torch would pull GBs of CUDA wheels
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[dev,plots]"
	# compile the planner's search loop once (numba caches it)
	$(PY) -c "from memo_ext.planner.solvers.canonical import warm_up; warm_up()"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	bash scripts/demo_cpu.sh

lint: $(STAMP)
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .

test: lint
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -p no:cacheprovider
	OMP_NUM_THREADS=1 $(PY) -m tests.emulated -q -p no:cacheprovider

# the edit-test loop: the unit tier without the tests marked slow (tool subprocesses, big traces)
test-fast: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -p no:cacheprovider tests/unit -m "not slow"

# the program's CUDA branch on this CPU machine (its own process: see tests/emulated)
test-emulated: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m tests.emulated -q -p no:cacheprovider

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

clean:
	rm -rf $(VENV) runs data build .pytest_cache .ruff_cache
