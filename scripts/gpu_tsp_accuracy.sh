#!/usr/bin/env bash
# Third of three consecutive GPU calls (see gpu_serve.sh): FastKV's TSP on the real SmolLM2 (bf16), the accuracy
# harness through the engine (dense and FreeKV's default selection, full prefill and TSP), then the same task
# against a FreeKV SGLang server with --kv-prefill tsp and the same settings. KEEP (default 1024), LAYER (14: the
# middle of 30 layers, as the paper's 15 of 32), TASKS (passkey,multikey), LENGTH (4096), BUDGET (512).
# RETRIEVAL=none serves TSP alone (SGLang's KV pool, page 1) instead of with FreeKV; ENGINE=0 skips the engine harness.
# GRID="LAYER:KEEP ..." runs the engine harness once per cell (each in $OUT/acc-engine-LAYER-KEEP); SERVER=0 skips the
# server; SAMPLES (20) per task.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results}; mkdir -p "$OUT"
source scripts/gpu_env.sh || exit 1
pkill -9 -f "^[^ ]*python[0-9.]* -m sglang.launch_server" 2>/dev/null; pkill -9 -f "^[^ ]*python[0-9.]* -m freekv_kvstore" 2>/dev/null
sleep 1
bash scripts/gpu_smollm2.sh build >/dev/null || exit 1
KEEP=${KEEP:-1024} LAYER=${LAYER:-14} TASKS=${TASKS:-passkey,multikey} LENGTH=${LENGTH:-4096} BUDGET=${BUDGET:-512}
ACC=(python3 -m freekv_sglang.accuracy --model /tmp/smollm2 --sink 64 --window 128 --page-size 16
     --samples "${SAMPLES:-20}" --lengths "$LENGTH" --budgets "$BUDGET")
if [ -n "${GRID:-}" ]; then
  for cell in $GRID; do
    echo "== TSP layer ${cell%%:*}, keep ${cell#*:}"
    "${ACC[@]}" --device cuda --dtype bf16 --batch 8 --tasks "$TASKS" --methods dense,sketch --kv-prefill full,tsp \
      --kv-tsp-layer "${cell%%:*}" --kv-tsp-keep "${cell#*:}" --out "$OUT/acc-engine-${cell/:/-}" 2>&1 | tail -n 20
  done
elif [ "${ENGINE:-1}" != 0 ]; then
  "${ACC[@]}" --device cuda --dtype bf16 --batch 8 --tasks "$TASKS" --methods dense,sketch --kv-prefill full,tsp \
    --kv-tsp-layer "$LAYER" --kv-tsp-keep "$KEEP" --out "$OUT/acc-engine" 2>&1 | tail -n 20
fi
[ "${SERVER:-1}" = 0 ] && exit 0
if [ "${RETRIEVAL:-freekv}" = none ]; then
  SERVE=(--page-size 1)
  LABEL="tsp(keep=$KEEP)-alone-server"
else
  SERVE=(--page-size 16 --kv-retrieval freekv --kv-budget "$BUDGET" --kv-sink 64 --kv-window 128 --kv-page-size 16
         --kv-correction-threshold 0.9 --kv-dense-layers 1 --kvstore-arena-gb 4)
  LABEL="freekv-tsp(keep=$KEEP)-server"
fi
PORT=30001
setsid "${SMOLLM2_SERVER[@]}" --port $PORT --attention-backend flashinfer \
  --sampling-backend pytorch --grammar-backend none --disable-radix-cache --disable-prefill-cuda-graph \
  --chunked-prefill-size -1 --mem-fraction-static 0.3 --max-running-requests 16 "${SERVE[@]}" \
  --kv-prefill tsp --kv-tsp-layer "$LAYER" --kv-tsp-keep "$KEEP" >"$OUT/server-tsp-$KEEP.log" 2>&1 &
SPID=$!
wait_healthy "$LABEL" $PORT $SPID "$OUT/server-tsp-$KEEP.log" 300 || exit 1
"${ACC[@]}" --backend sglang --url http://127.0.0.1:$PORT --tasks "$TASKS" \
  --server-method "$LABEL" --server-budget "$BUDGET" --out "$OUT/acc-server-$KEEP" 2>&1 | tail -n 12
kill -TERM -- -$SPID 2>/dev/null; sleep 3; kill -9 -- -$SPID 2>/dev/null
