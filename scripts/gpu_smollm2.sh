#!/usr/bin/env bash
# SmolLM2-135M-Instruct onto the GPU host in two consecutive calls (a transfer holds 64 MiB; the GGUF is 98 MB).
#   stash: run with .gpu-model/1 carried -> keeps part 1 in /tmp/smollm2-parts
#   build: run with .gpu-model/2 carried -> joins, checks sha256, converts to a bf16 HF folder /tmp/smollm2
# Make the parts here first with: bash ../shared/tools/gpu-smollm2.sh fetch
set -euo pipefail
cd "$(dirname "$0")/.."
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
case "${1:-}" in
stash)
  mkdir -p /tmp/smollm2-parts
  cp .gpu-model/1/part /tmp/smollm2-parts/part1; cp .gpu-model/1/SHA256 /tmp/smollm2-parts/SHA256
  echo "stashed part 1" ;;
build)
  [ -d /tmp/smollm2 ] && { echo "/tmp/smollm2 exists"; exit 0; }
  mkdir -p /tmp/smollm2-gguf
  cat /tmp/smollm2-parts/part1 .gpu-model/2/part >/tmp/smollm2-gguf/$GGUF
  echo "$(cat /tmp/smollm2-parts/SHA256)  /tmp/smollm2-gguf/$GGUF" | sha256sum -c -
  source scripts/gpu_env.sh
  python3 -W ignore - <<'PY'
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
src, f = "/tmp/smollm2-gguf", "SmolLM2-135M-Instruct.Q4_1.gguf"
AutoTokenizer.from_pretrained(src, gguf_file=f).save_pretrained("/tmp/smollm2")
AutoModelForCausalLM.from_pretrained(src, gguf_file=f, dtype=torch.bfloat16).save_pretrained("/tmp/smollm2")
print("built /tmp/smollm2")
PY
  ;;
*) sed -n 2,6p "$0"; exit 2 ;;
esac
