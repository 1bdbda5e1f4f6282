#!/usr/bin/env bash
# One call on the GPU host: kernel and engine tests on CUDA (no interpreter), then the benchmarks.
# Usage (device tool, carry .whl): bash scripts/gpu_check.sh [pytest-args...]
# Writes logs and JSON under $OUT (or ./results when OUT is unset).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/fkv-site .whl/*.whl || exit 1
fi
# Import names without installing: freekv_kernels -> kernels/, etc.
mkdir -p /tmp/fkv-src
for pair in freekv_sglang:freekv_sglang freekv_kernels:kernels freekv_kvstore:kvstore freekv_patches:patches; do
  ln -sfn "$PWD/${pair#*:}" "/tmp/fkv-src/${pair%%:*}"
done
export PYTHONPATH=/tmp/fkv-src:/tmp/fkv-site${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
rc=0
python3 -m pytest -q -p no:cacheprovider tests/kernels tests/engine/test_engine.py tests/engine/test_cuda_graph.py \
  tests/engine/test_launches.py "$@" \
  2>&1 | tee "$OUT/gpu-tests.log" | tail -n 25 || rc=1
python3 benchmarks/kernels.py --out "$OUT/kernels.json" 2>&1 | tee "$OUT/bench-kernels.log" | tail -n 60 || rc=1
exit $rc
