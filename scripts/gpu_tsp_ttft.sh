#!/usr/bin/env bash
# FastKV's token-selective propagation in the server (--kv-prefill tsp) against full prefill, one GPU, one run:
# time to first token (and the decode after it) on the Llama-3.1-8B shape with random weights, through
# benchmarks/decode.py (radix cache and prefill CUDA graphs off on every server, as TSP needs).
#   CONTEXT=32000 BATCHES=1,1,1 bash scripts/gpu_tsp_ttft.sh
# CONFIGS: decode.py configurations, ';'-separated (default: plain SGLang, FreeKV, FreeKV + TSP at the paper's
# layer 15 of 32 and 2048 propagated tokens; TSP prefills each prompt whole, --chunked-prefill-size -1).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results}; mkdir -p "$OUT"
source scripts/gpu_env.sh || exit 1
CONTEXT=${CONTEXT:-32000}
TSP="--kv-prefill tsp --kv-tsp-layer ${TSP_LAYER:-15} --kv-tsp-keep ${TSP_KEEP:-2048} --chunked-prefill-size -1"
CONFIGS=${CONFIGS:-"full;freekv;freekv $TSP"}
python3 benchmarks/decode.py --context "$CONTEXT" --batches "${BATCHES:-1,1,1}" --output-len "${OUTPUT_LEN:-64}" \
  --configs "${CONFIGS//;/,}" --radix-cache off --prefill-cuda-graph off --out "$OUT/tsp-$CONTEXT" 2>&1 | tail -n 30
