# Set-up and everyday commands. `make demo` and `make test` install what they need first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed

.PHONY: install install-gpu demo test test-fast test-gpu lint format bench clean

install: $(STAMP)

# torch first, on its own: where the package index serves the CPU wheel for `torch==2.13.0` it is
# taken; on plain PyPI (a CUDA build) `make install TORCH_INDEX=https://download.pytorch.org/whl/cpu`
# takes the CPU one. Every later install is
# constrained to it so nothing pulls a CUDA build. torchstore goes in without its stale pins,
# verl (whose losses the tests compare with ours) without its GPU stack.
$(STAMP): pyproject.toml constraints-cpu.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -c constraints-cpu.txt $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) torch
	$(PIP) install -q -c constraints-cpu.txt -e '.[launch,runtime,dev,peer]'
	$(PIP) install -q --no-deps torchstore==0.1.2 verl==0.9.1
	touch $(STAMP)

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
