# One command each: `make demo` and `make test` create .venv, install, and run.
#   make demo   installs the package alone (what the demo needs) and runs the demo
#   make test   installs it with the test extra (pytest, ruff, litgpt), then lints and tests: CI's command
#   make test-fast  the same without the tests marked ranks or slow (under a minute)
PYTHON ?= python3
VENV := .venv
# Stamps: the package installed, and the package with its test extra.
INSTALLED := $(VENV)/.installed
INSTALLED_TEST := $(VENV)/.installed-test
# Extra pytest arguments, e.g. `make test PYTEST_ARGS="-k bucketing"`.
PYTEST_ARGS ?=

.PHONY: install demo lint test test-fast

# uv, installed into .venv by pip, installs the rest: it fetches PyPI's 7 GB of torch and CUDA
# wheels in parallel, minutes faster than pip (CHANGELOG). It reads its own index settings
# (UV_INDEX_URL, uv.toml), not pip's configuration. --compile-bytecode compiles what it installs
# once, as pip does by default: where Python writes no bytecode itself (PYTHONDONTWRITEBYTECODE, as
# on this project's CI machines) every process would otherwise compile torch's and Thunder's
# sources again, 4 of the 7 s `import thunder` takes, in each of the tests' processes.
UV_VERSION := 0.13.9
UV_INSTALL := $(VENV)/bin/uv pip install --quiet --compile-bytecode --python $(VENV)/bin/python

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/bin/uv: | $(VENV)/bin/python
	$(VENV)/bin/pip install --quiet uv==$(UV_VERSION)

$(INSTALLED): pyproject.toml | $(VENV)/bin/uv
	$(UV_INSTALL) -e .
	touch $@

# The test extra includes the package, so it stands for both stamps.
$(INSTALLED_TEST): pyproject.toml | $(VENV)/bin/uv
	$(UV_INSTALL) -e '.[test]'
	touch $@ $(INSTALLED)

install: $(INSTALLED)

demo: $(INSTALLED)
	$(VENV)/bin/python -m thunder_overlap demo

lint: $(INSTALLED_TEST)
	$(VENV)/bin/ruff check thunder_overlap tests benchmarks examples

# Lint first: it takes a second, the tests minutes. pytest's exit status is make's, so a run
# that collects no test (exit 5) fails: CI cannot pass having run nothing.
# One pytest worker per core (pytest-xdist); tests/conftest.py groups the tests so the shared rank
# sessions and each module's fixtures are set up once, and puts the longest groups first (handed
# out in that order: --no-loadscope-reorder).
XDIST := -n auto --dist loadgroup --no-loadscope-reorder
# --durations: the slowest tests, where keeping the suite short starts.
test: lint
	$(VENV)/bin/python -m pytest -q -p no:cacheprovider $(XDIST) --durations=15 $(PYTEST_ARGS)

# Lint, then the synthetic, fake-group and one-rank tests that take under a second or so: those
# marked neither `ranks` (starts rank processes) nor `slow` (takes seconds); see pyproject.toml.
test-fast: lint
	$(VENV)/bin/python -m pytest -q -p no:cacheprovider $(XDIST) -m "not ranks and not slow" $(PYTEST_ARGS)
