# Each target sets up what it needs (idempotently): a local virtual environment with the CPU build of
# torch (a plain `torch` requirement would pull a multi-GB CUDA build), then het_plugin with its extras.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.het_plugin-installed

.PHONY: plan test unit integration bench clean

$(STAMP): pyproject.toml setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[megatron,deepspeed,dev]'
	touch $@

plan: $(STAMP)
	$(VENV)/bin/het-plugin plan $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q tests integration_tests

unit: $(STAMP)
	$(PY) -m pytest -q tests

bench: $(STAMP)
	$(PY) benchmarks/bench_planner.py $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
