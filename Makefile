# Each target sets up what it needs (idempotently): a local virtual environment with the CPU build of
# torch (a plain `torch` requirement would pull a multi-GB CUDA build), then het_plugin with its extras.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.het_plugin-installed
# The newest supported megatron-core, installed beside the venv's 0.16.1 and put first on PYTHONPATH for a
# second test pass. A Python-3.11 test measure: megatron-core 0.17+ declares Python >=3.12 but ships cp311
# wheels (users on 3.12+ simply `pip install megatron-core`); support/py311 supplies typing.override.
MCORE_NEW_VERSION := 0.19.2
MCORE_NEW := .mcore-$(MCORE_NEW_VERSION)
MCORE_NEW_STAMP := $(MCORE_NEW)/.installed
MCORE_NEW_ENV := PYTHONPATH=$(CURDIR)/$(MCORE_NEW):$(CURDIR)/integration_tests/support/py311 HET_TEST_MCORE=$(MCORE_NEW_VERSION)

# The releases between (their wheels hold the same megatron.core API): the Megatron unit tests against each.
# The multi-process megatron.training tests use 0.19's script shape (pretrain_gpt), so they run on 0.19.2 only.
MCORE_MID_VERSIONS := 0.17.0 0.18.0
MCORE_MID_STAMPS := $(foreach v,$(MCORE_MID_VERSIONS),.mcore-$(v)/.installed)

.PHONY: plan test test-core test-mcore-new unit integration bench clean

$(STAMP): pyproject.toml setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[megatron,deepspeed,dev]'
	touch $@

plan: $(STAMP)
	$(VENV)/bin/het-plugin plan $(ARGS)

$(MCORE_NEW_STAMP): $(STAMP)
	rm -rf $(MCORE_NEW)
	$(PY) -m pip install -q --no-deps --ignore-requires-python --target $(MCORE_NEW) \
		megatron-core==$(MCORE_NEW_VERSION) triton==3.9.0
	touch $@

.mcore-%/.installed: $(STAMP)
	rm -rf .mcore-$*
	$(PY) -m pip install -q --no-deps --ignore-requires-python --target .mcore-$* megatron-core==$* triton==3.9.0
	touch $@

# Every unit test and every non-Megatron integration test on megatron-core 0.16.1 (the venv), the Megatron unit
# tests on each release between, then every Megatron test, unit and multi-process, on the newest release. The
# multi-process Megatron tests run once, on 0.19.2 (the release megatron.training's scripts need): on 0.16.1 they
# repeated what the unit passes check on every release, for a third of CI's time.
test: $(STAMP) $(MCORE_NEW_STAMP) $(MCORE_MID_STAMPS)
	$(PY) -m pytest -q tests
	$(PY) -m pytest -q -m "not megatron" integration_tests
	for v in $(MCORE_MID_VERSIONS); do \
		PYTHONPATH=$(CURDIR)/.mcore-$$v:$(CURDIR)/integration_tests/support/py311 HET_TEST_MCORE=$$v \
			$(PY) -m pytest -q -m megatron tests || exit 1; done
	$(MCORE_NEW_ENV) $(PY) -m pytest -q -m megatron tests integration_tests

test-mcore-new: $(STAMP) $(MCORE_NEW_STAMP)
	$(MCORE_NEW_ENV) $(PY) -m pytest -q -m megatron tests integration_tests $(ARGS)

# The pure core alone: tests/core and tests/views, no processes, no torch needed.
test-core: $(STAMP)
	$(PY) -m pytest -q -m core tests/core tests/views

unit: $(STAMP)
	$(PY) -m pytest -q tests

bench: $(STAMP)
	$(PY) benchmarks/bench_planner.py $(ARGS)

clean:
	rm -rf $(VENV) $(MCORE_NEW) build *.egg-info .pytest_cache .hypothesis
