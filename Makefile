# Two commands on a fresh machine:  make up   (run the service)   ·   make test   (run the tests)
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
# No NVIDIA GPU here: offer pip PyTorch's CPU builds too (a plain index would give the multi-GB CUDA build)
TORCH_INDEX := $(if $(shell command -v nvidia-smi 2>/dev/null),,--extra-index-url https://download.pytorch.org/whl/cpu)

.PHONY: venv venv-test browser test test-gpu up bench clean

$(VENV)/.installed: pyproject.toml
	@echo "gaggle: creating $(VENV) (the first time takes a minute or two)"
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@echo "gaggle: installing torch 2.13.0 ($(if $(TORCH_INDEX),CPU build: no NVIDIA GPU found,CUDA build: nvidia-smi found))"
	$(PY) -m pip install -q --retries 1 torch==2.13.0 $(TORCH_INDEX)   # first: nothing else may pull another build
	# (--retries 1: where download.pytorch.org cannot be reached, each of torch's packages waited ~8 s for it)
	@echo "gaggle: installing gaggle (and the openai SDK, for trying it)"
	$(PY) -m pip install -q -e '.[client]'
	touch $@
	@echo "gaggle: $(VENV) is ready"

# The test tools (lm-eval, LangChain, Selenium, ...) only where tests run: the service does not need them.
$(VENV)/.installed-test: $(VENV)/.installed pyproject.toml
	@echo "gaggle: installing the test tools (the first time takes a minute or two)"
	$(PY) -m pip install -q -e '.[test]'
	touch $@

venv: $(VENV)/.installed

venv-test: $(VENV)/.installed-test

# The status-page test drives Debian's chromium; install it where it is missing (needs root and apt).
browser:
	@command -v chromedriver >/dev/null 2>&1 || { \
	  echo "gaggle: installing chromium and chromium-driver (apt) for the status-page test"; \
	  (apt-get install -y -q chromium chromium-driver >/dev/null 2>&1 || \
	   (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium chromium-driver >/dev/null 2>&1)) || \
	  echo "gaggle: could not install chromium (not root? no apt?): the browser test will be skipped"; }

test: venv-test browser
	$(PY) -m pytest -m "not gpu" -q $(PYTEST_ARGS)

test-gpu: venv-test
	$(PY) -m pytest -m gpu -q $(PYTEST_ARGS)

up: venv
	$(VENV)/bin/gaggle up $(ARGS)

# The CPU tables (any machine); a GPU host: bash benchmarks/run.sh all (benchmarks/README.md)
bench: venv
	$(PY) -m benchmarks.engine --device cpu
	$(PY) -m benchmarks.queue_overhead

clean:
	rm -rf $(VENV) .gaggle
