#!/usr/bin/env bash
# Bench-only environment for the REFERENCE trainer (vllm-project/speculators), never used by the
# pipeline: `.venv-ref` next to `.venv`. It exists to train speculators' EAGLE-3 draft on our own
# extracted hidden states (bench/reference_speculators.py) and compare it with eagle3/train/.
#
#   bench/reference/setup_env.sh            # creates .venv-ref (about 1.5 GB), prints the versions
#   PYTHON=python3.12 bench/reference/setup_env.sh
#
# Order matters: torch==2.13.0 is installed FIRST, alone, so that pip takes the CPU build it finds
# locally (/opt/wheels here) and nothing later pulls a CUDA torch. speculators' own requirements
# are then installed by name WITHOUT torchvision and torchaudio (speculators 0.9.0 lists both but
# its training path never imports them, and the PyPI builds of both fail to load beside a CPU
# torch, which then breaks transformers' model imports: docs/serving.md); speculators and
# its hs-connectors come last with --no-deps. transformers is pinned to the GPU machine's 5.17.0
# (speculators 0.9.0 accepts 5.0 to 5.19; the pipeline's .venv has 5.24, outside that range,
# which is why this is a separate environment).
#
# The exact versions installed are written to bench/reference/versions.txt (pip freeze).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3.11}
VENV=.venv-ref
SPECULATORS_VERSION=${SPECULATORS_VERSION:-0.9.0}

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
PIP="$VENV/bin/python -m pip"
$PIP install -q "torch==2.13.0"
$VENV/bin/python -c "import torch; assert not torch.version.cuda, torch.__version__; print('torch', torch.__version__)"
$PIP install -q \
  aiohttp click "datasets>=4.0.0,<=5.1.0" httpx huggingface-hub "loguru>=0.7.2,<=0.7.3" \
  "numpy>=2.0.0,<=2.5.4" "openai>=2.0.0" protobuf psutil "pydantic>=2.0.0" "pydantic-settings>=2.0.0" \
  rich safetensors "tqdm>=4.66.3,<=4.70.1" "transformers==5.17.0" "typer>=0.12.0" pyyaml
$PIP install -q --no-deps "speculators==${SPECULATORS_VERSION}" "hs-connectors==${SPECULATORS_VERSION}"
# still the CPU torch, and no torchvision/torchaudio crept in
$VENV/bin/python - <<'PY'
import importlib.util, torch
assert not torch.version.cuda, torch.__version__
for bad in ("torchvision", "torchaudio"):
    assert importlib.util.find_spec(bad) is None, f"{bad} got installed: remove it (it breaks transformers beside a CPU torch)"
from importlib.metadata import version
import speculators, transformers, datasets, hs_connectors  # noqa: F401
from speculators.train.cli import main  # noqa: F401  (the trainer imports cleanly)
print(*(f"{n} {version(n)}" for n in ("torch", "speculators", "hs-connectors", "transformers", "datasets")))
PY
{
  echo "# .venv-ref, written by bench/reference/setup_env.sh on $(date -u +%Y-%m-%dT%H:%MZ) with $($VENV/bin/python --version)"
  $PIP freeze --all
} > bench/reference/versions.txt
echo "versions: bench/reference/versions.txt"
