#!/usr/bin/env bash
# select_chain on one GPU in one call (carry .gpu-wheels), ~8 min on a fresh machine (the tests compile for ~5 min
# when its Triton cache is cold; session 47 cut them at 240 s, 21 s warm): the CUDA tests of the selection
# kernels (select_chain, select_slots and its victims, the top-k prototypes, the channel sketch), then select_chain
# stage by stage at the Qwen2.5-7B and Llama-3.1-8B attention shapes (1,000 pages: one launch; 3,750: the staged
# 120K selection), the top-k prototypes (the top-k alone, to split select_chain.py's "select" stage into top-k and
# commit) and the scoring kernel alone. Session 46's numbers to compare with: docs/results/session46 sections 1, 3, 5.
#   bash scripts/gpu_select_chain.sh
# Logs and JSON under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)  # absolute: the benchmarks run from benchmarks/
source scripts/gpu_env.sh || exit 1
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
timeout 360 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_select_chain.py \
  tests/kernels/test_page_select.py tests/kernels/test_page_select_victims.py tests/kernels/test_topk_proto.py \
  tests/kernels/test_channel_sketch.py 2>&1 | tee "$OUT/gpu-tests.log" | tail -n 4
cd benchmarks
for shape in qwen llama; do
  timeout 120 python3 select_chain.py --shape "$shape" --batches 16,1 --out "$OUT/select-chain-$shape.json" 2>&1 \
    | tee "$OUT/select-chain-$shape.log" | tail -n 6
done
timeout 120 python3 select_chain.py --pages 3750 --batches 4 --out "$OUT/select-chain-3750.json" 2>&1 \
  | tee "$OUT/select-chain-3750.log" | tail -n 4
timeout 120 python3 topk_proto.py --out "$OUT/topk-proto.json" 2>&1 | tee "$OUT/topk-proto.log" | tail -n 4
timeout 120 python3 sketch_lse.py --shapes llama,qwen --batches 16,1 --out "$OUT/sketch-lse.json" 2>&1 \
  | tee "$OUT/sketch-lse.log" | tail -n 10
