# Set-up and everyday commands. `make demo` and `make test` install what they need first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed

.PHONY: install demo test test-gpu lint format bench clean

install: $(STAMP)

# torch first, on its own: `pip install torch==2.13.0` takes the CPU wheel; every later install is
# constrained to it so nothing pulls a CUDA build. torchstore goes in without its stale pins.
$(STAMP): pyproject.toml constraints-cpu.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -c constraints-cpu.txt torch
	$(PIP) install -q -c constraints-cpu.txt -e '.[launch,runtime,dev]'
	$(PIP) install -q --no-deps torchstore==0.1.2
	touch $(STAMP)

demo: install
	$(VENV)/bin/forgesky local tiny

test: install
	$(PY) -m ruff check .
	$(PY) -m pytest -q

test-gpu: install
	$(PY) -m pytest -q -m gpu

lint: install
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: install
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

bench: install
	$(PY) bench/cli_latency.py

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
