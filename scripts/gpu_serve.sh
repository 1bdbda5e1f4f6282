#!/usr/bin/env bash
# Third of three consecutive GPU calls (1: wheelhouse -> /tmp/site, 2: model part 1): builds SmolLM2 and
# compares a plain SGLang server with a FreeKV server. Extra args go to scripts/serve_check.py.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results}; mkdir -p "$OUT"
source scripts/gpu_env.sh || exit 1
# Servers of an earlier call on this (warm) machine would hold GPU memory.
# Python processes only: a caller's shell whose command line names them must survive.
pkill -9 -f "^[^ ]*python[0-9.]* -m sglang.launch_server" 2>/dev/null; pkill -9 -f "^[^ ]*python[0-9.]* -m freekv_kvstore" 2>/dev/null
sleep 1
bash scripts/gpu_smollm2.sh build || exit 1
python3 scripts/serve_check.py --model /tmp/smollm2 --out "$OUT" "$@" 2>&1 | tee "$OUT/serve-check.log" | tail -n 60
