# Two commands on a fresh machine:  make up   (run the service)   ·   make test   (run the tests)
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: venv test test-gpu up bench clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0   # first, so nothing pulls a multi-GB CUDA build on CPU machines
	$(PY) -m pip install -q -e '.[test]'
	touch $@

venv: $(VENV)/.installed

test: venv
	$(PY) -m pytest -m "not gpu" -q $(PYTEST_ARGS)

test-gpu: venv
	$(PY) -m pytest -m gpu -q $(PYTEST_ARGS)

up: venv
	$(VENV)/bin/gaggle up $(ARGS)

bench: venv
	$(PY) -m engine.bench --device cpu
	$(PY) -m worker.bench

clean:
	rm -rf $(VENV) .gaggle
