#!/bin/bash
# Issue 15's train-step measurements in one device call (docs/benchmarks.md, "Train stage"):
# Kimi-K2.5 draft dims, batch 1 x 2048: eager and fast at TTT 7 (with phases and top kernels)
# and TTT 3, the MLA draft at TTT 7, the SmolLM2-dims draft with the train stage's GPU settings
# at TTT 3, and the fast-vs-eager loss/gradient match in bf16. Logs and JSON results go to
# $OUT/results.tgz (rewritten after every run, so a call cut short still returns what ran) and a
# line per run to $OUT/summary.txt (the device tool returns at most 8 files).
#
#   bash bench/train_gpu.sh [PART]                            # on the GPU machine; PART 1, 2
#                                                             #   or 3: a third of the runs each
#                                                             #   (a device call lasts <= 600 s)
#   K="--seq 64 --steps 1" S="--seq 64 --steps 1" M="--seq 48" PY=.venv/bin/python \
#       OUT=/tmp/o bash bench/train_gpu.sh                     # a dry run on CPU, tiny shapes
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/train-gpu}
RES=${RES:-/tmp/train-gpu-results}
PY=${PY:-python3}
K=${K:---kimi}          # Kimi dims (default seq 2048, batch 1, 10 steps)
S=${S:---steps 50}      # SmolLM2 dims (default 4 x 512 = 2048 tokens, the demo's token budget)
M=${M:---kimi}          # the match runs
mkdir -p "$OUT" "$RES"
if [ -d .whl ] && ! $PY -c "import pydantic" 2>/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl > "$RES/pip.log" 2>&1
    export PYTHONPATH=/tmp/site:$PWD
fi
git rev-parse HEAD > "$RES/commit.txt" 2>/dev/null || true
(nvidia-smi; $PY -c "import torch; print(torch.__version__, torch.version.cuda)") \
    > "$RES/machine.txt" 2>&1
START=$(date +%s)
PART=${1:-all}
N=0

pack() {  # name of the run just done: its summary line, then everything so far into the tarball
    echo "$1" | tee -a "$OUT/summary.txt"
    tar czf "$OUT/results.tgz" -C "$RES" .
}

mine() {  # whether run number N belongs to PART (1: runs 1-4, 2: runs 5-9, 3: the rest)
    N=$((N + 1))
    case "$PART" in
    all) return 0 ;;
    1) [ "$N" -le 4 ] ;;
    2) [ "$N" -ge 5 ] && [ "$N" -le 9 ] ;;
    *) [ "$N" -ge 10 ] ;;
    esac
}

run() {  # name, seconds, bench/train.py arguments
    mine || return 0
    local name=$1 limit=$2
    shift 2
    timeout "$limit" $PY bench/train.py "$@" --json-out "$RES/$name.json" > "$RES/$name.log" 2>&1
    local rc=$?
    pack "$name rc=$rc t=$(($(date +%s) - START))s $(grep -E '^step |MFU' "$RES/$name.log" | tr '\n' ' ')"
}

match() {  # name, seconds, bench/train_match.py arguments
    mine || return 0
    local name=$1 limit=$2
    shift 2
    timeout "$limit" $PY bench/train_match.py "$@" --json-out "$RES/$name.json" \
        > "$RES/$name.log" 2>&1
    local rc=$?
    local got
    got=$($PY -c 'import json, sys; r = json.load(open(sys.argv[1])); print(r["fast_vs_eager"],
"once vs per_use", r["once_vs_per_use"]["overall"], "vs fp32: eager",
r["eager"]["grad_vs_fp32"]["overall"], r["eager"]["loss_rel"], "fast",
r["fast"]["grad_vs_fp32"]["overall"], r["fast"]["loss_rel"], "fast_per_use",
r["fast_per_use"]["grad_vs_fp32"]["overall"])' "$RES/$name.json" 2>&1)
    pack "$name rc=$rc t=$(($(date +%s) - START))s $got"
}

# the issue's acceptance runs first (the loader: argmax once per sample, the next batch padded on
# a thread; frozen head as speculators trains it; the stage's weight cast "once": one bf16 copy
# per forward, the TTT steps' weight gradients summed in fp32), then the same with autocast
# casting at every use (session 8's fast step) and with autocast's cache (bf16 sum)
run kimi-fast-ttt7 90 $K --ttt 7 --profile
run kimi-fast-ttt7-frozen-compile 150 $K --ttt 7 --freeze-head --compile --profile
run kimi-fast-ttt3-frozen-compile 120 $K --ttt 3 --freeze-head --compile
run kimi-fast-ttt7-frozen-compile-peruse 150 $K --ttt 7 --freeze-head --compile --weight-cast per_use --profile
run kimi-mla-fast-ttt7 70 $K --arch mla --ttt 7
run smollm2-fast-ttt3-b16 60 $S --ttt 3 --batch 16
run smollm2-fast-ttt3-b16-compile 120 $S --ttt 3 --batch 16 --compile
run kimi-fast-ttt7-frozen-compile-cache 150 $K --ttt 7 --freeze-head --compile --weight-cast cache
match match-kimi-ttt3 70 $M --ttt 3
run kimi-fast-ttt7-frozen-compile-noprefetch 150 $K --ttt 7 --freeze-head --compile --prefetch off
run kimi-eager-ttt7 90 $K --ttt 7 --impl eager --profile
run kimi-fast-ttt3 60 $K --ttt 3
run kimi-mla-eager-ttt7 70 $K --arch mla --ttt 7 --impl eager
run smollm2-fast-ttt3 60 $S --ttt 3
run smollm2-fast-ttt3-syncs 40 $S --ttt 3 --steps 3 --sync-debug
match match-kimi-mla-ttt3 70 $M --arch mla --ttt 3
pack "done t=$(($(date +%s) - START))s"
