#!/usr/bin/env bash
# FP8 host pages (--kv-host-dtype fp8_e4m3) on the GPU host, one call (carry .gpu-wheels): their kernel and engine
# tests on CUDA, then the recall before attention and the speculative recall beside other work, bf16 against FP8
# arenas (benchmarks/kernels.py --host-dtype). Logs and JSON under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results}; mkdir -p "$OUT"
source scripts/gpu_env.sh || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
rc=0
python3 -m pytest -q -p no:cacheprovider tests/kernels/test_fp8_rows.py tests/kernels/test_recall.py \
  tests/kernels/test_offload.py tests/kernels/test_page_copy.py tests/engine/test_fp8_host.py \
  tests/engine/test_radix_prefix.py tests/kvstore/test_kvstore_cuda.py 2>&1 | tee "$OUT/gpu-tests.log" | tail -n 8 || rc=1
for hd in auto fp8_e4m3; do
  python3 benchmarks/kernels.py --host-dtype "$hd" --only-recall-blocks --recall-programs 132 --recall-slot-blocks 4 \
    --out "$OUT/recall-blocks-$hd.json" 2>&1 | tee "$OUT/recall-blocks-$hd.log" | tail -n 7 || rc=1
  python3 benchmarks/kernels.py --host-dtype "$hd" --only-recall-beside --out "$OUT/recall-beside-$hd.json" 2>&1 \
    | tee "$OUT/recall-beside-$hd.log" | tail -n 14 || rc=1
done
exit $rc
