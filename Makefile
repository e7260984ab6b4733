# One command each: `make demo` and `make test` create .venv, install, and run.
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: install demo test

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/python -m thunder_overlap demo

# pytest exits 5 when it collects no test; that is not a failure of the code.
test: $(STAMP)
	$(VENV)/bin/python -m pytest -q -p no:cacheprovider; rc=$$?; if [ $$rc -eq 5 ]; then exit 0; fi; exit $$rc
