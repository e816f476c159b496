# rl_core: the two commands of the README, plus helpers.
#   make run   - set up .venv and run the embedded default (tiny model learns addition on CPU)
#   make test  - set up .venv and run every test tier
SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.rl_core-installed
PYTHON ?= python3

.PHONY: setup run test test-unit test-integration docs clean

$(STAMP): requirements.txt pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "[setup] installing the pinned requirements into $(VENV) (first time: ~2 minutes)"
	@$(PY) -m pip install -q --disable-pip-version-check -r requirements.txt 2>&1 | { grep -v "is ignored: it is neither" || true; }
	@$(PY) -m pip install -q --disable-pip-version-check --no-deps -e . 2>&1 | { grep -v "is ignored: it is neither" || true; }
	@touch $(STAMP)

setup: $(STAMP)

run: setup
	$(VENV)/bin/rl-core train recipes/tiny-addition.yaml

test: setup
	$(PY) -m pytest tests

test-unit: setup
	$(PY) -m pytest tests/unit

test-integration: setup
	$(PY) -m pytest tests/integration

docs: setup
	$(VENV)/bin/rl-core docs --format markdown > docs/recipe-reference.md

clean:
	rm -rf results .snakemake .pytest_cache
