# The two commands of the README: `make demo` (main job) and `make test` (test suite).
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: setup demo test lint clean

$(VENV)/.installed: pyproject.toml scripts/setup.sh
	scripts/setup.sh
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(VENV)/bin/oomb demo

test: setup
	$(PY) -m pytest -q tests

lint: setup
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
