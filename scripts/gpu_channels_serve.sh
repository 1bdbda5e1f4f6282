#!/usr/bin/env bash
# Issue 18: the channel sketch served (--kv-selection channels, calibrated at start-up), in four consecutive calls on
# one warm machine (a transfer holds 64 MiB; the machine goes back after 30 minutes held):
#   bash scripts/gpu_channels_serve.sh decode   (carry .gpu-wheels)   benchmarks/decode.py, realistic churn,
#       the sketch (the default before session 24) vs channels vs MeanS: SHAPE (default qwen2.5-7b), BATCHES (default 16),
#       CONFIGS and FREEKV_ARGS (decode.py's --freekv-args, e.g. a larger --kvstore-arena-gb for 16 x 32K) override
#   bash scripts/gpu_channels_serve.sh stash    (carry .gpu-model/1)  SmolLM2 part 1
#   bash scripts/gpu_channels_serve.sh harness  (carry .gpu-model/2)  the accuracy harness through the engine, 20
#       samples: passkey, multikey and vartrack at 4K and 8K, budgets 512 and 1024, channels and the sketch
#   bash scripts/gpu_channels_serve.sh server                         a FreeKV SGLang server with --kv-selection
#       channels on SmolLM2 and the harness through it (passkey and multikey at 8K, budget 1024)
# Logs and JSON under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results}; mkdir -p "$OUT"
source scripts/gpu_env.sh || exit 1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
ACC=(python3 -m freekv_sglang.accuracy --model /tmp/smollm2 --sink 64 --window 128 --page-size 16 --samples 20)
case "${1:-}" in
decode)
  python3 benchmarks/decode.py --shape "${SHAPE:-qwen2.5-7b}" --context 32000 --batches "${BATCHES:-16}" \
    --configs "${CONFIGS:-realistic,realistic --kv-selection channels,realistic --kv-selection means}" \
    ${FREEKV_ARGS:+--freekv-args "$FREEKV_ARGS"} --prefill-cuda-graph off --output-len 128 --out "$OUT/decode" 2>&1 |
    tail -n 25
  grep -h "calibrated" "$OUT"/decode/*.log 2>/dev/null | head -n 3 ;;
stash)
  bash scripts/gpu_smollm2.sh stash ;;
harness)
  bash scripts/gpu_smollm2.sh build >/dev/null || exit 1
  "${ACC[@]}" --device cuda --dtype bf16 --batch 10 --tasks passkey,multikey,vartrack --lengths 4096,8192 \
    --budgets 512,1024 --methods channels,sketch --out "$OUT/acc-engine" 2>&1 | tail -n 60 ;;
server)
  pkill -9 -f freekv_kvstore 2>/dev/null; sleep 1
  PORT=30001
  setsid "${SMOLLM2_SERVER[@]}" --port $PORT --attention-backend flashinfer \
    --sampling-backend pytorch --grammar-backend none --disable-radix-cache --page-size 16 --mem-fraction-static 0.3 \
    --max-running-requests 16 --kv-retrieval freekv --kv-selection channels --kv-budget 1024 \
    --kv-sink 64 --kv-window 128 --kv-page-size 16 --kv-correction-threshold 0.9 --kv-dense-layers 1 --kvstore-arena-gb 4 \
    >"$OUT/server-channels.log" 2>&1 &
  SPID=$!
  wait_healthy freekv-channels $PORT $SPID "$OUT/server-channels.log" 400 || exit 1
  grep -m1 "calibrated" "$OUT/server-channels.log"
  "${ACC[@]}" --backend sglang --url http://127.0.0.1:$PORT --tasks passkey,multikey --lengths 8192 --budgets 1024 \
    --server-method freekv-server-channels --server-budget 1024 --out "$OUT/acc-server" 2>&1 | tail -n 14
  kill -TERM -- -$SPID 2>/dev/null; sleep 3; kill -9 -- -$SPID 2>/dev/null ;;
*) sed -n 2,11p "$0"; exit 2 ;;
esac
