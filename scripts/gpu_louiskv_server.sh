#!/usr/bin/env bash
# Issue 21 on one GPU: a LouisKV SGLang server against a FreeKV server on SmolLM2-135M through the accuracy harness.
# Two consecutive calls on one warm machine (a transfer holds 64 MiB):
#   bash scripts/gpu_smollm2.sh stash        (carry .gpu-model/1)
#   bash scripts/gpu_louiskv_server.sh       (carry .gpu-model/2)
# Both servers: budget 1024, sink 64, window 128, page 16, one dense layer, triton attention, radix cache off (LouisKV
# cannot share host pages), --chunked-prefill-size 2048 so an 8K prompt arrives in four chunks (LouisKV clusters it
# in the last one's forward). FreeKV at correction threshold 0.9 (the default selection), LouisKV at boundary 0.7 (the
# paper's default; LOUISKV_TAU overrides). Tasks: passkey, multikey, vartrack at 8K and the long-output codechain,
# codechain16 at 4K, 20 samples each. Each server logs its retrieval statistics every 64 decode steps
# (FREEKV_STATS_EVERY): the last line of each is printed. Logs and records.jsonl under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results}; mkdir -p "$OUT"
source scripts/gpu_env.sh || exit 1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
bash scripts/gpu_smollm2.sh build >/dev/null || exit 1
ACC=(python3 -m freekv_sglang.accuracy --model /tmp/smollm2 --sink 64 --window 128 --page-size 16 --samples 20
     --backend sglang --budgets 1024 --server-budget 1024 --out "$OUT/acc-louiskv-server")
PORT=30001
COMMON=(--kv-budget 1024 --kv-sink 64 --kv-window 128 --kv-page-size 16 --kv-dense-layers 1 --kvstore-arena-gb 4)
for srv in freekv louiskv; do
  if [ $srv = freekv ]; then flags=(--kv-retrieval freekv "${COMMON[@]}" --kv-correction-threshold 0.9)
  else flags=(--kv-retrieval louiskv "${COMMON[@]}" --kv-boundary-threshold "${LOUISKV_TAU:-0.7}"); fi
  FREEKV_STATS_EVERY=64 setsid "${SMOLLM2_SERVER[@]}" --port $PORT \
    --attention-backend triton --sampling-backend pytorch --grammar-backend none --disable-radix-cache --page-size 16 \
    --mem-fraction-static 0.3 --max-running-requests 16 --chunked-prefill-size 2048 \
    "${flags[@]}" \
    >"$OUT/server-$srv.log" 2>&1 &
  SPID=$!; t0=$(date +%s); up=1
  until python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$PORT/health', timeout=2)" 2>/dev/null; do
    kill -0 $SPID 2>/dev/null || { echo "$srv server exited"; tail -30 "$OUT/server-$srv.log"; up=0; break; }
    [ $(( $(date +%s) - t0 )) -lt 240 ] || { echo "$srv not healthy"; up=0; break; }
    sleep 2
  done
  if [ $up = 1 ]; then
    "${ACC[@]}" --url http://127.0.0.1:$PORT --tasks passkey,multikey,vartrack --lengths 8192 \
      --server-method "server-$srv" 2>&1 | tail -n 4
    "${ACC[@]}" --url http://127.0.0.1:$PORT --tasks codechain,codechain16 --lengths 4096 \
      --server-method "server-$srv" 2>&1 | tail -n 6
    grep "decode steps, correction rate" "$OUT/server-$srv.log" | tail -n 1
  fi
  kill -TERM -- -$SPID 2>/dev/null; sleep 3; kill -9 -- -$SPID 2>/dev/null
done
