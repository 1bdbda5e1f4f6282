#!/usr/bin/env bash
# Served decode A/B on one GPU machine: benchmarks/decode.py with the arguments given (FreeKV configurations), first
# from a base tree, then from this working tree, then full KV once with the same arguments (FULL=0 skips it):
# $OUT/base.json, $OUT/new.json, $OUT/full.json. Here, before the call, the base tree's code only (a whole tree and
# the 51 MB wheelhouse together are over the 64 MiB a call carries):
#   mkdir -p .ab/base && git archive REF freekv_sglang kernels kvstore patches benchmarks scripts pyproject.toml \
#     | tar -x -C .ab/base
# then carry .ab/base and .gpu-wheels, and run e.g.
#   bash scripts/gpu_decode_ab.sh --shape llama-3.1-8b --context 32000 --batches 16,1 \
#     --configs "realistic-victim --kv-host-dtype fp8_e4m3" --freekv-args "--kv-budget 2048 ..." --output-len 256
set -uo pipefail
BASE=${BASE:-.ab/base} OUT=${OUT:-results} FULL=${FULL:-1}
[ -f "$BASE/benchmarks/decode.py" ] || { echo "no base tree in $BASE" >&2; exit 2; }
mkdir -p "$OUT"
root=$PWD
args=("$@")
full=()  # the same arguments, --configs full
for ((i = 0; i < ${#args[@]}; i++)); do
  if [ "${args[i]}" = --configs ]; then i=$((i + 1)); else full+=("${args[i]}"); fi
done
decode() {  # decode SIDE DIR ARGS...: decode.py from DIR (gpu_env.sh links freekv_* to the directory it is sourced from)
  local side=$1 dir=$2; shift 2
  [ -e "$dir/.gpu-wheels" ] || ln -s "$root/.gpu-wheels" "$dir/.gpu-wheels"
  rm -rf "/tmp/ab-$side"  # a failed run must not leave an earlier call's results to copy
  (cd "$dir" && source scripts/gpu_env.sh && python3 benchmarks/decode.py "$@" --out "/tmp/ab-$side") 2>&1 \
    | sed "s/^/[$side] /"
  cp "/tmp/ab-$side/decode.json" "$OUT/$side.json"
}
decode base "$root/$BASE" "${args[@]}"
decode new "$root" "${args[@]}"
[ "$FULL" = 0 ] || decode full "$root" "${full[@]}" --configs full
