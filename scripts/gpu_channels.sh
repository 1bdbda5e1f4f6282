#!/usr/bin/env bash
# Issue 18's channel sketch on one GPU in three consecutive calls on one warm machine (a transfer holds 64 MiB):
#   bash scripts/gpu_channels.sh check  (carry .gpu-wheels)   CUDA tests of the selection kernels, kernels.py's
#       selection rows at 32K, 1 and 16 requests (MeanS, the sketch, rerank/2, the channel sketch at 32 and 64)
#   bash scripts/gpu_channels.sh stash  (carry .gpu-model/1)  SmolLM2 part 1
#   bash scripts/gpu_channels.sh study  (carry .gpu-model/2)  selection_study.py on SmolLM2 (20 samples, 8K, budget
#       512): passkey, multikey and vartrack with the channel sketch calibrated once from Python's argparse source;
#       passkey calibrated from random tokens and per request. CALIBRATIONS (task:text ...), SAMPLES and MAX_NEW
#       (decode steps per sample) override.
# Logs and JSON under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results}; mkdir -p "$OUT"
source scripts/gpu_env.sh || exit 1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
case "${1:-}" in
check)
  python3 -m pytest -q -p no:cacheprovider tests/kernels/test_channel_sketch.py tests/kernels/test_page_rerank.py \
    2>&1 | tee "$OUT/gpu-tests.log" | tail -n 4
  python3 benchmarks/kernels.py --only-selection --contexts 32768 --batches 1,16 --repeats 10 --rerank-factors 2 \
    --sketch-channels 32 --channel-widths 32,64 --out "$OUT/kernels-selection.json" 2>&1 \
    | tee "$OUT/bench-kernels.log" | grep -A 20 "^selection per layer" ;;
stash)
  bash scripts/gpu_smollm2.sh stash ;;
study)
  bash scripts/gpu_smollm2.sh build >/dev/null || exit 1
  for run in ${CALIBRATIONS:-passkey:stdlib multikey:stdlib vartrack:stdlib passkey:random passkey:request}; do
    task=${run%%:*}; cal=${run#*:}
    flags=(--calibration model --calibration-text "$cal"); [ "$cal" = request ] && flags=(--calibration request)
    python3 benchmarks/selection_study.py --device cuda --model /tmp/smollm2 --task "$task" --length 8192 --samples "${SAMPLES:-20}" \
      --budget 512 ${MAX_NEW:+--max-new "$MAX_NEW"} "${flags[@]}" --out "$OUT/study-$task-$cal.json" >"$OUT/study-$task-$cal.log" 2>&1
    echo "== $task, calibration $cal: $(grep -m1 budget "$OUT/study-$task-$cal.log")"
    grep -E "^(oracle|means|code2-byte8q|static32-g4z|channels[0-9]+) " "$OUT/study-$task-$cal.log"
  done ;;
*) sed -n 2,9p "$0"; exit 2 ;;
esac
