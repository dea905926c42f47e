# The two commands a new user runs: `make demo` and `make test`. Both install first when needed.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
CONSTRAINTS ?= ci/constraints-cpu.txt
# three workers on two cores: a sixth of the suite's time is spent waiting (on Slurm, sshd, a child's start, a
# stop's bound), and a third worker computes meanwhile (the whole suite 538 -> 505 s on 2 cores, measured)
JOBS ?= 3
# by test module: a module's module-scoped fixtures (a grid, a torchrun world, a killed run) are built once, not
# once in each worker that gets one of its tests; modules in the order tests/conftest.py gives them (heaviest first)
DIST ?= loadfile --no-loadscope-reorder

.PHONY: install bytecode demo test test-fast test-gpu bench lint clean

$(BIN)/opalctl: pyproject.toml $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c $(CONSTRAINTS) -e ".[dev]"
	@touch $@

install: $(BIN)/opalctl

# the bytecode of the package and the tests' helper modules, written before the suite: the suite starts about 900
# Python processes (each run's evaluator and steps writer, agent hosts and workers, the runs a grid or a test starts),
# and where PYTHONDONTWRITEBYTECODE is set (this machine's image sets it) each compiled again every opalctl module it
# imported: a 20-update digits run took 4.3-5.0 CPU-s, 3.7-4.1 with the bytecode written; a fresh clone's suite
# 662 s before, 580 and 621 s after (measured on this host). compileall writes only what changed since; a file it
# cannot compile is printed and skipped (the leading -): the bytecode saves time, it is not a check
bytecode: install
	-@$(BIN)/python -m compileall -q opalctl tests

demo: install
	$(BIN)/opalctl demo

test: bytecode
	$(BIN)/python -m pytest -n $(JOBS) --dist $(DIST) tests

# the quick lane while working: every test but those that start real runs, grids and browsers, train through
# Hugging Face's Trainer or Lightning, or prepare a task's data a second time (tests/conftest.py)
test-fast: bytecode
	$(BIN)/python -m pytest -n $(JOBS) --dist $(DIST) -m "not slow" tests

# the CUDA tests (tests/gpu): refused, saying so, where no CUDA device is visible, so a pass means they ran
test-gpu: install
	@$(BIN)/python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'make test-gpu: no CUDA device is visible (torch.cuda.is_available() is False); run it on a machine with a GPU and a CUDA build of torch')"
	OPALCTL_REQUIRE_GPU=1 $(BIN)/python -m pytest -rs tests/gpu

bench: install
	# the peer is installed only as a comparison for bench/overhead.py (never imported by opalctl)
	-$(BIN)/python -m pip install --quiet -c $(CONSTRAINTS) opal-optimizer
	$(BIN)/python bench/run_all.py

lint: install
	$(BIN)/ruff check opalctl tests bench

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
