# One command each: `make demo` and `make test` create .venv, install, and run.
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed
# Extra pytest arguments, e.g. `make test PYTEST_ARGS="-k bucketing"`.
PYTEST_ARGS ?=

.PHONY: install demo lint test

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/python -m thunder_overlap demo

lint: $(STAMP)
	$(VENV)/bin/ruff check thunder_overlap tests benchmarks

# Lint first: it takes a second, the tests minutes. pytest's exit status is make's, so a run
# that collects no test (exit 5) fails: CI cannot pass having run nothing.
test: lint
	$(VENV)/bin/python -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)
