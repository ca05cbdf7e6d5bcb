#!/usr/bin/env bash
# Wheels the reference trainer (bench/reference_speculators.py) needs on the GPU machine and that
# its image does not have, into .whl/ (ignored by git; carried by the device tool with
# carry: [".whl"]), for Python 3.12 manylinux x86_64 (the H200 image: python 3.12.3, torch 2.11,
# transformers 5.17, huggingface_hub 1.33, pyarrow, pandas, fsspec, httpx, aiohttp, numpy 2.5 ...:
# /work/.library/device/KINDS.md, "Python packages already there").
#
#   bench/reference/fetch_wheels.sh       # then: ls -la .whl
#
# The list is what a full run of the script imported in .venv-ref (speculators 0.9.0's training
# path: datasets, openai, pydantic(-settings), loguru, hs-connectors, ...) minus the packages the
# image has, plus the small dependencies whose minimum versions the image may not meet (anyio,
# idna, h11, typing_extensions, sniffio: newer versions of those are drop-in). Versions are the
# ones .venv-ref was tested with (bench/reference/versions.txt). 22 wheels, 7.2 MiB in all:
#   speculators 0.9.0 (256K), hs-connectors 0.9.0 (24K), datasets 5.1.0 (590K), dill 0.4.1, multiprocess
#   0.70.19 (py312), openai 3.60.0 (2.4M), httpx2 2.16.2, httpcore2 2.16.2, truststore 0.10.5, jiter 0.19.0
#   (cp312, 330K), sniffio 1.3.1, pydantic 2.14.4 (480K), pydantic_core 2.50.5 (cp312, 2.2M),
#   pydantic-settings 2.16.3, annotated-types 0.8.0, typing-inspection 0.4.5, typing_extensions 4.16.0,
#   python-dotenv 1.2.4, loguru 0.7.3, anyio 4.16.0, idna 3.20, h11 0.16.0.
# Checked here: with only the image's packages (those of .venv-ref that KINDS.md lists) plus these
# wheels (cp311 builds of the three version-tagged ones) on the path, the whole script ran (convert,
# train, export, estimate).
#
# On the machine (README of the device tool):
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
#
# Not carried: pyarrow (datasets 5.1.0 asks for >= 24; the image has a pyarrow of its own, version
# not recorded; if `import datasets` fails there, add pyarrow to NAMES below: about 45 MiB).
set -euo pipefail
cd "$(dirname "$0")/../.."
VERSIONS=bench/reference/versions.txt
NAMES="speculators hs-connectors datasets dill multiprocess openai httpx2 httpcore2 truststore jiter sniffio
pydantic pydantic_core pydantic-settings annotated-types typing-inspection typing_extensions python-dotenv loguru
anyio idna h11 ${EXTRA_NAMES:-}"
rm -rf .whl && mkdir -p .whl
for name in $NAMES; do
  pin=$(grep -i "^${name}==" "$VERSIONS" | head -1)
  [ -n "$pin" ] || { echo "no pin for $name in $VERSIONS" >&2; exit 1; }
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "$pin" 2>&1 | grep -v "^WARNING: Location" || true
  ls .whl | grep -qi "^$(echo "$name" | tr '-' '_')-" || ls .whl | grep -qi "^${name}-" || { echo "not downloaded: $pin" >&2; exit 1; }
done
ls -la .whl
du -sh .whl
