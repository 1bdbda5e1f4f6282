#!/usr/bin/env bash
# select_chain on one GPU in one call (carry .gpu-wheels), ~9 min on a fresh machine: select_chain before attention
# at the Qwen2.5-7B and Llama-3.1-8B shapes with what follows it (+after: the recall and the token lists, two more
# launches); the recall before attention alone by --kv-recall-block (benchmarks/recall_before.py); then the CUDA tests
# of the selection, recall and token-list kernels and of the engine's row-kernel attention, in the call's time left
# (a cold Triton cache compiles for ~5 min; 21 s warm). Numbers to compare with: docs/results/session48.
#   bash scripts/gpu_select_chain.sh
# Logs and JSON under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)  # absolute: the benchmarks run from benchmarks/
source scripts/gpu_env.sh || exit 1
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
cd benchmarks
for shape in qwen llama; do
  timeout 120 python3 select_chain.py --shape "$shape" --batches 16,1 --stages +replay,+after \
    --out "$OUT/select-chain-$shape.json" 2>&1 | tee "$OUT/select-chain-$shape.log" | tail -n 5
  timeout 120 python3 recall_before.py --shape "$shape" --batches 16,1 --out "$OUT/recall-before-$shape.json" 2>&1 \
    | tee "$OUT/recall-before-$shape.log" | tail -n 4
done
cd ..
# The tests last, in the time left of a 600 s call (cold Triton caches compile for ~5 min).
timeout $((570 - SECONDS)) python3 -m pytest -q -p no:cacheprovider tests/kernels/test_select_chain.py tests/kernels/test_recall.py \
  tests/kernels/test_token_index.py tests/kernels/test_page_select_victims.py tests/engine/test_triton_head_attention.py \
  tests/engine/test_flashinfer_attention.py 2>&1 | tee "$OUT/gpu-tests.log" | tail -n 4
