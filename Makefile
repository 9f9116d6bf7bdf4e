# The two commands of the README. Both set up .venv first (scripts/setup.sh is idempotent).
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup demo test
setup:
	@bash scripts/setup.sh $(VENV)

# Main job on the embedded default: reference model, synthetic data, 2 local ranks on CPU.
demo: setup
	$(VENV)/bin/freescale train --nproc 2 --steps 20 --summary-json out/demo-summary.json

test: setup
	$(PY) -m pytest -q -x --timeout 300 tests
