# Two set-up commands for a fresh machine (README.md):
#   make demo   installs into .venv and runs the main job (zeroio train, built-in default)
#   make test   installs into .venv and runs the whole test suite
# torch: a GPU user's own torch is kept (the venv sees system site-packages);
# where none is importable, torch==2.13.0 (the CPU build on this kind of machine) is installed.
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: venv demo test lint clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev,hf]"
	touch $@

venv: $(VENV)/.installed

demo: venv
	$(VENV)/bin/zeroio train

test: venv
	$(PY) -m pytest -q $(PYTEST_ARGS)

lint: venv
	$(VENV)/bin/ruff check zeroio tests benchmarks

clean:
	rm -rf $(VENV) zeroio_run
