# make demo  — train a small GPT on 2 CPU processes (the built-in demo configuration)
# make test  — lint, then every tier on every core: unit, gloo (jobs in worker processes started
#              once), the end-to-end launches, then the emulated-CUDA tier
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
	bash scripts/demo_cpu.sh $(DEMO_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .

# pytest-xdist: one test process per core (each runs its training jobs in a pool of its own);
# worksteal: an idle process takes queued tests from a busy one (the long ones run first).
# The cores are counted without OMP_NUM_THREADS, which `nproc` obeys and clusters often export
# as 1 (the tests set it for their own jobs); JOBS=N chooses.
XDIST := -n $(or $(JOBS),$(shell env -u OMP_NUM_THREADS nproc)) --dist worksteal

test: lint
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -p no:cacheprovider $(XDIST) tests
	$(MAKE) --no-print-directory test-emulated

# the emulated tier measured by coverage.py (every process it starts), then the share of the
# program's GPU-only branches it ran
EMULATED_COVERAGE := COVERAGE_PROCESS_START=$(CURDIR)/.coveragerc

# the edit-test loop: the unit tier without the slow tests and the launches
test-fast: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -p no:cacheprovider $(XDIST) tests/unit -m "not slow and not launch"

# the program's CUDA branch on this CPU machine (its own processes: see tests/emulated)
test-emulated: $(STAMP)
	rm -rf build/coverage && mkdir -p build/coverage
	$(EMULATED_COVERAGE) OMP_NUM_THREADS=1 $(PY) -m tests.emulated -q -p no:cacheprovider $(XDIST)
	$(PY) -m tests.emulated.cuda_coverage --fail-under 90

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

clean:
	rm -rf $(VENV) runs data build .pytest_cache .ruff_cache
