#!/usr/bin/env bash
# Issue 18's cost under realistic query churn, one GPU call (the wheelhouse already in /tmp/site from an earlier call,
# or .gpu-wheels carried): the step-timing GPU tests; benchmarks/kernels.py's selection rows per layer (every head
# selecting) with the sketch reading 32 and 16 channels; then benchmarks/engine_decode.py with structured keys (churn
# fitted to SmolLM2), the POLICIES (default: the sketch, rerank/2 with a 16-channel sketch, MeanS) at the correction
# thresholds in TAUS, each step's selection and recall timed per phase by the engine's timing events (--step-timing),
# and with EVENTS=1 per batch one row without the events and one with the server's 4 timed layers (the events' own
# cost). Rows merge into $OUT/engine-decode-cost.json as each config ends.
#   BATCHES=1,16 TAUS=0.9 STEPS=256 bash scripts/gpu_selection_cost.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results}; mkdir -p "$OUT"
source scripts/gpu_env.sh || exit 1
BATCHES=${BATCHES:-1,16}; TAUS=${TAUS:-0.9}; STEPS=${STEPS:-256}; CONTEXT=${CONTEXT:-32768}
POLICIES=${POLICIES:-freekv,freekv-rerank,freekv-means}
JSON="$OUT/engine-decode-cost.json"
if [ "${TESTS:-1}" != 0 ]; then
  python3 -m pytest -q -p no:cacheprovider tests/engine/test_cuda_graph.py -k step_timing 2>&1 | tail -n 3
fi
if [ "${KERNELS:-1}" != 0 ]; then
  for ch in 32 16; do
    python3 benchmarks/kernels.py --only-selection --contexts "$CONTEXT" --batches "$BATCHES" --repeats 10 \
      --rerank-factors 2 --sketch-channels $ch --out "$OUT/kernels-selection-c$ch.json" 2>&1 | grep -v "^{" | tail -n 12
  done
fi
ED=(python3 benchmarks/engine_decode.py --keys structured --contexts "$CONTEXT" --batches "$BATCHES" --steps "$STEPS"
    --out "$JSON")
for tau in ${TAUS//,/ }; do
  "${ED[@]}" --policies "$POLICIES" --tau "$tau" --step-timing 2>&1 | grep -v "^{\|^|" | tail -n 3
done
if [ "${EVENTS:-0}" != 0 ]; then  # the events' own cost: without them, and with the server's 4 timed layers
  "${ED[@]}" --policies freekv --tau "${TAUS%%,*}" 2>&1 | grep -v "^{\|^|" | tail -n 3
  "${ED[@]}" --policies freekv --tau "${TAUS%%,*}" --step-timing --timed-layers 4 2>&1 | grep -v "^{\|^|" | tail -n 3
fi
python3 - "$JSON" <<'PY'
import json, sys
sys.path.insert(0, "benchmarks")
from engine_decode import table
print(table(json.load(open(sys.argv[1]))["rows"]))
PY
