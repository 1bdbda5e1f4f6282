#!/usr/bin/env bash
# First look at issue 6: full-KV SGLang (FlashInfer) against FreeKV (wrapping FlashInfer) on a random-weight
# Llama-3.1-8B shape at 32K context, 1 and 4 concurrent requests, CUDA graphs on. Needs /tmp/site.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results}; mkdir -p "$OUT"
source scripts/gpu_env.sh || exit 1
rm -rf /tmp/llama8b; python3 scripts/make_dummy_model.py llama-3.1-8b /tmp/llama8b >/dev/null || exit 1
PORT=30002
run() {  # run NAME ARGS...
  local name=$1; shift
  pkill -9 -f sglang.launch_server 2>/dev/null; pkill -9 -f freekv_kvstore 2>/dev/null; sleep 2
  FREEKV_STATS_EVERY=256 setsid python3 -m sglang.launch_server --model-path /tmp/llama8b --load-format dummy --port $PORT \
    --attention-backend flashinfer --sampling-backend pytorch --grammar-backend none --disable-radix-cache --page-size 32 \
    --context-length 34000 --max-running-requests 4 --mem-fraction-static 0.6 "$@" >"$OUT/server-$name.log" 2>&1 &
  local spid=$!
  wait_healthy "$name" $PORT $spid "$OUT/server-$name.log" 300 || return 1
  for c in 1 4; do
    echo "$name concurrency $c:"
    python3 benchmarks/serve_load.py --url http://127.0.0.1:$PORT --input-len 32000 --output-len 128 --num-prompts $c \
      --concurrency $c --vocab 128000 --out "$OUT/decode-$name-c$c.json" | tail -n 2
  done
  grep FreeKV "$OUT/server-$name.log" | tail -n 2
  kill -TERM -- -$spid 2>/dev/null; sleep 3; kill -9 -- -$spid 2>/dev/null
}
run full-kv
run freekv --kv-retrieval freekv --kv-budget 2048 --kv-sink 128 --kv-window 512 --kv-page-size 32 --kvstore-arena-gb 24
