#!/usr/bin/env bash
# Issue 18 on one GPU in three consecutive calls on one warm machine (a transfer holds 64 MiB):
#   bash scripts/gpu_selection.sh check   (carry .gpu-wheels)   CUDA tests of the selection kernels and the engine,
#       kernels.py (selection cost per layer: means / quest / rerank), profile_step.py (Llama-3.1-8B shape, 32K,
#       batch 16: the graph-captured step with rerank against means)
#   bash scripts/gpu_selection.sh stash   (carry .gpu-model/1)  SmolLM2 part 1
#   bash scripts/gpu_selection.sh accuracy (carry .gpu-model/2) the accuracy harness through the engine (every method),
#       then the same prompts through a plain SGLang server and a FreeKV server (triton attention: no JIT). DTYPE
#       (bfloat16) is the harness's dtype; the servers run bfloat16 (sgl_kernel's rmsnorm has no float32). METHODS
#       (every one), LENGTHS (4096,8192) and BUDGETS (512,1024) for the harness; the servers run 8K at budget 1024,
#       with a context length 2 tokens above the model's 8,192 (gpu_env.sh's SMOLLM2_SERVER says why).
#   bash scripts/gpu_selection.sh speed   (carry .gpu-wheels; a call of its own: FlashInfer's first start JIT-builds)
#       decode.py on the Llama-3.1-8B shape at 32K, 1 and 16 requests: full KV, FreeKV with the default selection,
#       with rerank/0 and with MeanS
# Logs and JSON under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results}; mkdir -p "$OUT"
source scripts/gpu_env.sh || exit 1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
case "${1:-}" in
check)
  python3 -m pytest -q -p no:cacheprovider tests/kernels/test_page_rerank.py tests/kernels/test_offload.py \
    tests/engine/test_engine.py::test_triton_backend_equals_torch_backend tests/engine/test_engine.py::test_tau_one_selects_with_current_query \
    2>&1 | tee "$OUT/gpu-tests.log" | tail -n 8
  python3 benchmarks/kernels.py --only-selection --contexts 32768,131072 --batches 1,16 --repeats 10 \
    --out "$OUT/kernels.json" 2>&1 | tee "$OUT/bench-kernels.log" | grep -A 24 "^selection per layer"
  python3 benchmarks/profile_step.py --batches 16 --context 32000 \
    --rows "${ROWS:-0.9:drifting:delta:means,0.9:drifting:delta:rerank/2,0.9:drifting:delta:rerank/0,1:drifting:delta:means,1:drifting:delta:rerank/2}" \
    --out "$OUT/profile-step.json" 2>&1 | tee "$OUT/profile-step.log" | grep -E '^\{|^batch|_rerank|_sketch|_page_logits|_top_pages' ;;
stash)
  bash scripts/gpu_smollm2.sh stash ;;
accuracy)
  pkill -9 -f sglang.launch_server 2>/dev/null; pkill -9 -f freekv_kvstore 2>/dev/null; sleep 1
  bash scripts/gpu_smollm2.sh build >/dev/null || exit 1
  ACC=(python3 -m freekv_sglang.accuracy --model /tmp/smollm2 --sink 64 --window 128 --page-size 16 --samples 20
       --rerank-factor "${RERANK:-2}")
  # RESUME: a records.jsonl of an earlier call to go on from (finished cells are skipped).
  mkdir -p "$OUT/acc-engine"; [ -n "${RESUME:-}" ] && cp "$RESUME" "$OUT/acc-engine/records.jsonl"
  DTYPE=${DTYPE:-bfloat16}
  [ "${SERVERS_ONLY:-0}" = 1 ] || "${ACC[@]}" --device cuda --dtype "$DTYPE" --batch 10 \
    --tasks passkey,multikey,vartrack --lengths "${LENGTHS:-4096,8192}" --budgets "${BUDGETS:-512,1024}" \
    ${METHODS:+--methods "$METHODS"} --out "$OUT/acc-engine" 2>&1 | tail -n 75
  PORT=30001
  [ "${ENGINE_ONLY:-0}" = 1 ] && exit 0
  for srv in plain freekv; do
    flags=()
    [ $srv = freekv ] && flags=(--kv-retrieval freekv --kv-budget 1024 --kv-sink 64 --kv-window 128 --kv-page-size 16
                                --kv-correction-threshold 0.9 --kv-dense-layers 1 --kvstore-arena-gb 4)
    setsid "${SMOLLM2_SERVER[@]}" --port $PORT --attention-backend triton \
      --sampling-backend pytorch --grammar-backend none --disable-radix-cache --page-size 16 --mem-fraction-static 0.3 \
      --max-running-requests 16 "${flags[@]}" >"$OUT/server-$srv.log" 2>&1 &
    SPID=$!; t0=$(date +%s)
    until python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$PORT/health', timeout=2)" 2>/dev/null; do
      kill -0 $SPID 2>/dev/null || { echo "$srv server exited"; tail -30 "$OUT/server-$srv.log"; break; }
      [ $(( $(date +%s) - t0 )) -lt 240 ] || { echo "$srv not healthy"; break; }
      sleep 2
    done
    "${ACC[@]}" --backend sglang --url http://127.0.0.1:$PORT --tasks passkey,multikey,vartrack --lengths 8192 \
      --budgets 1024 --server-method "server-$srv" --server-budget 1024 --out "$OUT/acc-server" 2>&1 | tail -n 4
    kill -TERM -- -$SPID 2>/dev/null; sleep 3; kill -9 -- -$SPID 2>/dev/null
  done ;;
speed)
  python3 benchmarks/decode.py --shape llama-3.1-8b --context 32000 --batches 1,16 --output-len 128 \
    --configs "full,freekv,freekv --kv-rerank-factor 0,freekv --kv-selection means" --out "$OUT/decode" 2>&1 | tail -n 30 ;;
*) sed -n 2,12p "$0"; exit 2 ;;
esac
