#!/usr/bin/env bash
# Third of three consecutive GPU calls (see gpu_serve.sh): the accuracy harness through the engine on the
# GPU (every method), then passkey at ~8K against a FreeKV SGLang server with the same FreeKV settings.
# ATTENTION_BACKEND (default flashinfer) is the backend the server's FreeKV wraps; ENGINE=0 skips the engine grid.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results}; mkdir -p "$OUT"
source scripts/gpu_env.sh || exit 1
pkill -9 -f sglang.launch_server 2>/dev/null; pkill -9 -f freekv_kvstore 2>/dev/null; sleep 1
bash scripts/gpu_smollm2.sh build >/dev/null || exit 1
ACC=(python3 -m freekv_sglang.accuracy --model /tmp/smollm2 --sink 64 --window 128 --page-size 16 --samples 20)
if [ "${ENGINE:-1}" != 0 ]; then
  "${ACC[@]}" --device cuda --dtype bf16 --batch 8 --tasks passkey,multikey --lengths 4096,8192 --budgets 512,1024 \
    --out "$OUT/acc-engine" 2>&1 | tail -n 45
fi
PORT=30001
setsid "${SMOLLM2_SERVER[@]}" --port $PORT --attention-backend "${ATTENTION_BACKEND:-flashinfer}" \
  --sampling-backend pytorch --grammar-backend none --disable-radix-cache --page-size 16 --mem-fraction-static 0.3 \
  --max-running-requests 16 --kv-retrieval freekv --kv-budget 1024 --kv-sink 64 \
  --kv-window 128 --kv-page-size 16 --kv-correction-threshold 0.9 --kv-dense-layers 1 --kvstore-arena-gb 4 \
  >"$OUT/server-acc.log" 2>&1 &
SPID=$!
wait_healthy freekv $PORT $SPID "$OUT/server-acc.log" 300 || exit 1
"${ACC[@]}" --backend sglang --url http://127.0.0.1:$PORT --tasks passkey --lengths 8192 --budgets 1024 \
  --server-method freekv-server-tau0.9 --server-budget 1024 --out "$OUT/acc-server" 2>&1 | tail -n 12
kill -TERM -- -$SPID 2>/dev/null; sleep 3; kill -9 -- -$SPID 2>/dev/null
