# The two commands of the README. Both set up .venv first (scripts/setup.sh is idempotent).
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup demo test stress
setup:
	@bash scripts/setup.sh $(VENV)

# Main job on the embedded default: the softmax model, synthetic data, 2 local ranks on CPU.
demo: setup
	$(VENV)/bin/freescale train --nproc 2 --steps 20 --summary-json out/demo-summary.json

test: setup
	$(VENV)/bin/ruff format --check . && $(VENV)/bin/ruff check .
	$(PY) -m pytest -q -x --timeout 300 tests

# Not part of CI: the multi-process tests N times in a row, each failure reported (scripts/stress_multiprocess.sh).
N ?= 10
stress: setup
	@PY=$(PY) bash scripts/stress_multiprocess.sh $(N)
