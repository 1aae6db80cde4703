# Set-up and everyday commands. `make demo` and `make test` install what they need first.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
# Every package but torch and forgesky, pinned with hashes: `make lock` writes it.
LOCK   := cpu-stack.txt
# The Python the lock is for (its first line) and the one PYTHON is: make install refuses a mismatch.
LOCK_PYTHON = $(shell sed -n '1s/.* for Python \([0-9.]*\) .*/\1/p' $(LOCK))
HAVE_PYTHON = $(shell $(PYTHON) -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)
# Where `make lock` finds torch's CPU wheels (a folder or a page of links); PyPI has the CUDA build.
TORCH_WHEELS ?= https://download.pytorch.org/whl/cpu/torch/

.PHONY: install install-gpu lock demo test test-fast test-gpu lint format bench clean

install: $(STAMP)

# Into a cleared venv: torch from constraints-cpu.txt, then the lock exactly (it sets every
# package torch brought to its pin), then forgesky. Where the package index serves the CPU wheel
# for `torch==2.13.0` it is taken; on plain PyPI it is the CUDA build, which brings the CUDA
# libraries it pins (`make install TORCH_INDEX=https://download.pytorch.org/whl/cpu` takes the
# CPU one). pip check's only complaints may be torchstore's and verl's own requirements: both go
# in without them (scripts/cpu/lock.py says why).
$(STAMP): pyproject.toml constraints-cpu.txt $(LOCK)
	$(if $(filter $(LOCK_PYTHON),$(HAVE_PYTHON)),,$(error $(LOCK) is locked for Python $(LOCK_PYTHON) but $(PYTHON) is $(or $(addprefix Python ,$(HAVE_PYTHON)),not found): make install PYTHON=python$(LOCK_PYTHON)))
	@echo "make install: a few minutes; builds $(VENV) from $(LOCK), about 3.5 GB with the CPU build of torch"
	$(PYTHON) -m venv --clear $(VENV)
	$(PIP) install -q -c constraints-cpu.txt $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) torch
	$(PIP) install -q --require-hashes --no-deps --only-binary :all: -r $(LOCK)
	$(PIP) install -q --no-deps --no-build-isolation -e .
	$(PIP) check > $(VENV)/pip-check.txt || ! grep -v -E '^(torchstore|verl) ' $(VENV)/pip-check.txt
	touch $(STAMP)

# Resolve the lock again, on purpose (PyPI as of now); commit cpu-stack.txt with what changed.
lock:
	$(if $(wildcard $(PY)),$(PY),$(PYTHON)) scripts/cpu/lock.py --torch-wheels $(TORCH_WHEELS)

demo: install
	$(VENV)/bin/forgesky local tiny

test: install
	$(PY) -m ruff check .
	$(PY) -m pytest -q

# The unit tests without the end-to-end runs of the runtime (marked slow): a few minutes.
test-fast: install
	$(PY) -m ruff check .
	$(PY) -m pytest -q -m 'not gpu and not slow'

# On a GPU machine: the tests marked gpu, in a venv of their own with vLLM's torch (CUDA build).
# GPU_PY=python3 uses an environment that already has the stack (scripts/gpu/device_run.sh).
GPU_VENV := .venv-gpu
GPU_PY ?= $(GPU_VENV)/bin/python
GPU_STAMP := $(GPU_VENV)/.installed

install-gpu: $(GPU_STAMP)

$(GPU_STAMP): pyproject.toml
	$(PYTHON) -m venv $(GPU_VENV)
	$(GPU_VENV)/bin/python -m pip install -q --upgrade pip
	$(GPU_VENV)/bin/python -m pip install -q torch==2.11.0 vllm==0.24.0 -e '.[runtime,gpu,dev]'
	$(GPU_VENV)/bin/python -m pip install -q --no-deps torchstore==0.1.2
	touch $(GPU_STAMP)

test-gpu:
	@if [ "$(GPU_PY)" = "$(GPU_VENV)/bin/python" ]; then $(MAKE) install-gpu; fi
	$(GPU_PY) -m pytest -q -m gpu $(ARGS)

lint: install
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: install
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

bench: install
	$(PY) bench/cli_latency.py

clean:
	rm -rf $(VENV) $(GPU_VENV) runs .pytest_cache .ruff_cache
