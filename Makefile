# The two commands of the README: `make train` (main job) and `make test` (the fast test tier); `make demo`
# and `make test-all` (every test: the fast tier and the tests marked slow) too.
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: setup demo train test test-all lint clean

$(VENV)/.installed: pyproject.toml scripts/setup.sh
	scripts/setup.sh
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(VENV)/bin/oomb demo

train: setup
	$(VENV)/bin/oomb train --overwrite

test: setup
	$(PY) -m pytest -q -m "not slow" tests

test-all: setup
	$(PY) -m pytest -q tests

lint: setup
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
