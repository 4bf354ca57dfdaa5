# The two commands of the README: `make train` (main job) and `make test` (test suite); `make demo` too.
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: setup demo train test lint clean

$(VENV)/.installed: pyproject.toml scripts/setup.sh
	scripts/setup.sh
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(VENV)/bin/oomb demo

train: setup
	$(VENV)/bin/oomb train --overwrite

test: setup
	$(PY) -m pytest -q tests

lint: setup
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
