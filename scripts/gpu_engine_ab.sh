#!/usr/bin/env bash
# Engine-only decode A/B on one GPU machine: benchmarks/engine_decode.py with ARGS, first from a base checkout, then
# from this working tree, interleaved ROUNDS times (the two share the machine's state), JSON per run in $OUT.
#   git archive REF | tar -x -C .device/base      # here, before the call; carry .device/base and .gpu-wheels
#   ARGS="--contexts 32768 --batches 16 --steps 256 --host-gb 50 --policies freekv-replay" bash scripts/gpu_engine_ab.sh
set -euo pipefail
BASE=${BASE:-.device/base} ROUNDS=${ROUNDS:-1} OUT=${OUT:-results}
[ -f "$BASE/benchmarks/engine_decode.py" ] || { echo "no base checkout in $BASE" >&2; exit 2; }
mkdir -p "$OUT"
root=$PWD
for r in $(seq 1 "$ROUNDS"); do
  for side in base new; do
    dir=$root; [ "$side" = base ] && dir=$root/$BASE
    # gpu_env.sh links freekv_* to the directory it is sourced from.
    [ "$side" = base ] && [ ! -e "$dir/.gpu-wheels" ] && ln -s "$root/.gpu-wheels" "$dir/.gpu-wheels"
    (cd "$dir" && source "$root/scripts/gpu_env.sh" && \
     python3 benchmarks/engine_decode.py $ARGS --out "$OUT/$side-$r.json") 2>&1 | sed "s/^/[$side $r] /"
  done
done
