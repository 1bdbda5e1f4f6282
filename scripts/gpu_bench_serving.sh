#!/usr/bin/env bash
# FreeKV server on a random-weight Llama-3.1-8B shape at ~32K context under concurrent load
# (benchmarks/serve_load.py, random token ids: sglang.bench_serving needs `datasets`, absent offline). Needs /tmp/site (the wheelhouse) on the GPU host.
# Usage: bash scripts/gpu_bench_serving.sh [ATTENTION_BACKEND]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results}; mkdir -p "$OUT"
source scripts/gpu_env.sh || exit 1
pkill -9 -f sglang.launch_server 2>/dev/null; pkill -9 -f freekv_kvstore 2>/dev/null; sleep 1
BACKEND=${1:-triton}
rm -rf /tmp/llama8b; python3 scripts/make_dummy_model.py llama-3.1-8b /tmp/llama8b || exit 1
PORT=30001
FREEKV_STATS_EVERY=64 setsid python3 -m sglang.launch_server --model-path /tmp/llama8b --load-format dummy --port $PORT \
  --attention-backend "$BACKEND" --sampling-backend pytorch --grammar-backend none --disable-radix-cache \
  --context-length 34000 --max-running-requests 8 --mem-fraction-static 0.5 \
  --kv-retrieval freekv --kv-budget 2048 --kv-sink 128 --kv-window 512 --kv-page-size 32 --kvstore-arena-gb 24 \
  >"$OUT/server-llama8b-freekv.log" 2>&1 &
SPID=$!
wait_healthy freekv $PORT $SPID "$OUT/server-llama8b-freekv.log" 400 || exit 1
python3 benchmarks/serve_load.py --url http://127.0.0.1:$PORT --input-len 32000 --output-len 256 \
  --num-prompts 8 --concurrency 4 --vocab 128000 --out "$OUT/serve-load-llama8b-freekv.json" 2>&1 | tee "$OUT/serve-load.log"
rc=${PIPESTATUS[0]}
grep -E "FreeKV|Traceback|Error" "$OUT/server-llama8b-freekv.log" | tail -n 12
kill -TERM -- -$SPID 2>/dev/null; sleep 3; kill -9 -- -$SPID 2>/dev/null
exit $rc
