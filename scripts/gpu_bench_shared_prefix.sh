#!/usr/bin/env bash
# Issue 20, deliverable 4: SGLang's serving benchmark on its generated-shared-prefix dataset (benchmarks/
# bench_shared_prefix.py runs `sglang.benchmark.serving` offline) against a FreeKV server with its radix cache and a
# full-KV SGLang server with its radix cache, random-weight Llama-3.1-8B shape, FlashInfer (or $ATTENTION_BACKEND). Groups of requests share
# a long system prompt (GSP_SYSTEM tokens, default 16K); each request adds its own question and answer.
# Needs /tmp/site (the wheelhouse). Usage: [RUNS=freekv,full] bash scripts/gpu_bench_shared_prefix.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results}; mkdir -p "$OUT"
source scripts/gpu_env.sh || exit 1
RUNS=${RUNS:-freekv,full} GSP_SYSTEM=${GSP_SYSTEM:-16384}
rm -rf /tmp/llama8b; python3 scripts/make_dummy_model.py llama-3.1-8b /tmp/llama8b >/dev/null || exit 1
PORT=30004
COMMON=(--model-path /tmp/llama8b --load-format dummy --tokenizer-path /tmp/llama8b/tokenizer --port $PORT
        --attention-backend "${ATTENTION_BACKEND:-flashinfer}" --page-size 32 --sampling-backend pytorch --grammar-backend none
        --context-length 34000 --max-running-requests 16 --chunked-prefill-size 8192 --mem-fraction-static 0.6)
for name in ${RUNS//,/ }; do
  case $name in
    freekv) extra=(--kv-retrieval freekv --kv-budget 2048 --kv-sink 128 --kv-window 512 --kv-page-size 32
                   --kvstore-arena-gb 40) ;;
    full) extra=() ;;
    *) echo "unknown run $name (RUNS: freekv, full)"; exit 2 ;;
  esac
  FREEKV_STATS_EVERY=256 setsid python3 -m sglang.launch_server "${COMMON[@]}" "${extra[@]}" \
    >"$OUT/server-gsp-$name.log" 2>&1 &
  spid=$!
  wait_healthy "$name" $PORT $spid "$OUT/server-gsp-$name.log" 400 || continue
  timeout 300 python3 benchmarks/bench_shared_prefix.py --backend sglang --port $PORT \
    --dataset-name generated-shared-prefix --tokenizer /tmp/llama8b/tokenizer --seed 1 \
    --gsp-num-groups 4 --gsp-prompts-per-group 16 --gsp-system-prompt-len "$GSP_SYSTEM" --gsp-question-len 256 \
    --gsp-output-len 128 --num-prompts 64 --max-concurrency 16 --output-file "$OUT/gsp-$name.jsonl" 2>&1 \
    | grep -v "it/s\]" | tail -n 30
  grep -E "FreeKV rank|Traceback" "$OUT/server-gsp-$name.log" | tail -n 3
  kill -TERM -- -$spid 2>/dev/null; sleep 3; kill -9 -- -$spid 2>/dev/null
done
