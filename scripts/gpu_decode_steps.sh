#!/usr/bin/env bash
# Issue 23's served decode cells on the Llama-3.1-8B shape, one named step a device call, so that a session's calls
# follow each other on one warm machine (the device gives it back 30 s after a call: issue the next step at once).
# Each step runs benchmarks/decode.py with session 49's flags and writes $OUT/STEP.json and a trimmed log; the
# first call on a fresh machine carries .gpu-wheels (its FreeKV server starts in ~6 min: SGLang and FlashInfer JIT,
# the arena's pre-fault, the calibration, Triton compiling during graph capture). Every step's servers share one
# Triton cache on the machine, so a warm machine's later FreeKV servers load their kernels instead.
#   bash scripts/gpu_decode_steps.sh predicted    # FreeKV, --kv-correct-at previous_mlp_only, 16 and 1 x 32K, with
#                                                 # --kv-attention backend (the default until session 57; the
#                                                 # steps below that name no attention run the default, fused)
#   bash scripts/gpu_decode_steps.sh full         # full KV (FlashInfer), 16 and 1 x 32K
#   bash scripts/gpu_decode_steps.sh fused        # predicted with --kv-attention fused (attend_pages, the default
#                                                 # since session 57), 16 and 1 x 32K
#   bash scripts/gpu_decode_steps.sh fp8w         # fused with --kv-early-weights fp8 (the early lane's W_q in e4m3)
#   bash scripts/gpu_decode_steps.sh programs     # predicted at 16 x 32K with --kv-recall-programs 48, then 64
#   bash scripts/gpu_decode_steps.sh blocks       # predicted at 16 x 32K with --kv-recall-block 4, then 16 (the early
#                                                 # lane's recall in fewer programs, which priority -2 puts ahead of
#                                                 # the MLP's CTAs)
#   bash scripts/gpu_decode_steps.sh trace        # predicted at 16 and 1 x 32K, 2 profiled steps, trace_layers
#                                                 # (the raw traces come back gzipped for timeline reading)
#   bash scripts/gpu_decode_steps.sh lanes        # no server: the green-context and channel-sketch GPU tests, the
#                                                 # scoring kernel against .ab/base's (benchmarks/sketch_lse.py), then
#                                                 # benchmarks/side_lanes.py (the speculative lanes beside the model's
#                                                 # kernels, on every SM or confined to 16-48, and the early
#                                                 # lane beside the MLP), all lanes, each alone, one request
#   bash scripts/gpu_decode_steps.sh thin         # no server: side_lanes.py, each side kernel alone beside the
#                                                 # critical lane, as served and with thinner CTAs (--warps), the
#                                                 # recall with 16 and 64 programs (fewer or more CTAs of one size),
#                                                 # then all three lanes with the thinnest of each
#   bash scripts/gpu_decode_steps.sh copy         # no server: side_lanes.py with the speculative recall's host pages
#                                                 # as one run through a copy engine (dma: the transfer alone;
#                                                 # staged: then the served recall kernel reading it from HBM)
#                                                 # against the served recall, at 16 rows and 1; then the host's
#                                                 # gather of those pages by thread count (host_gather.py)
#   bash scripts/gpu_decode_steps.sh attn         # no server: side_lanes.py with the served attention paths in the
#                                                 # critical lane (FlashInfer's, attend_pages at 1-8 splits), every
#                                                 # lane beside it, at 16 rows and 1; then the early lane's
#                                                 # W_q in e4m3 (--kv-early-weights fp8); first the GPU tests of
#                                                 # fp8_linear, attend_pages and the fused engine path
#   bash scripts/gpu_decode_steps.sh fp8          # no server: fp8_linear's GPU tests, then benchmarks/fp8_linear.py
#                                                 # (its tiles swept against bf16 x @ W^T at 1, 4 and 16 rows)
#   bash scripts/gpu_decode_steps.sh score        # predicted at 16 x 32K with --kv-score-programs 132, then
#                                                 # --kv-speculate-at attention (where the scoring sits without a
#                                                 # correction chain before attention)
#   bash scripts/gpu_decode_steps.sh default      # FreeKV's default correction (realistic-victim), 16 and 1 x 32K
#   bash scripts/gpu_decode_steps.sh long         # full KV and predicted at 4 x 120K
#   bash scripts/gpu_decode_steps.sh long8        # predicted with --kv-early-weights fp8 at 4 x 120K
#   bash scripts/gpu_decode_steps.sh qwen         # the Qwen2.5-7B shape at 16 x 32K: full KV, then predicted with
#                                                 # --kv-early-weights fp8 (issue 23's 0.70x target there)
#   bash scripts/gpu_decode_steps.sh base         # predicted at 16 x 32K from an older tree in .ab/base, carried:
#     mkdir -p .ab/base && git archive REF freekv_sglang kernels kvstore patches benchmarks scripts pyproject.toml \
#       | tar -x -C .ab/base
# A batch listed three times runs three times on one server (the same prompts, so the repeats hit the radix cache and
# skip most of the prefill): three decode medians of one configuration, for A/Bs of a few percent where two runs of
# one configuration differ by ~1%.
# LIMIT (seconds, default 570) caps a step; a step that runs out leaves what it finished.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
LIMIT=${LIMIT:-570}
source scripts/gpu_env.sh || exit 1
FP8="--kv-host-dtype fp8_e4m3"
FA="--kv-budget 2048 --kv-sink 128 --kv-window 512 --kv-page-size 32 --kvstore-arena-gb 40"

left() {  # the step's seconds left; fails once none are (timeout 0 would mean no limit at all)
  local n=$((LIMIT - SECONDS))
  ((n > 0)) && echo $n || { echo "out of time (LIMIT $LIMIT s)" >&2; return 1; }
}

decode() {  # decode NAME DECODE_ARGS...: one decode.py run under the step's time left, from the tree in $TREE
  local name=$1 t; shift
  t=$(left) || return 0
  rm -rf "/tmp/steps-$name"
  (cd "${TREE:-.}" && source scripts/gpu_env.sh && timeout $t python3 benchmarks/decode.py \
     --shape llama-3.1-8b --freekv-args "$FA" --prefill-cuda-graph off --output-len 128 "$@" \
     --triton-cache /tmp/steps-triton-cache --out "/tmp/steps-$name") 2>&1 | grep -v '^\[' | cut -c1-300 | tee "$OUT/$name.log" | tail -n 8
  cp "/tmp/steps-$name/decode.json" "$OUT/$name.json" 2>/dev/null || echo "$name: no decode.json"
}

thin() {  # thin NAME SIDE_LANES_ARGS...: one side_lanes.py run on every SM
  local name=$1 t; shift
  t=$(left) || return 0
  timeout $t python3 benchmarks/side_lanes.py --sms 0 "$@" --out "$OUT/thin-$name.json" 2>&1 \
    | tee -a "$OUT/thin.log" | tail -n 2
}

case ${1:-} in
  predicted) decode predicted --context 32000 --batches 16,16,16,1,1 \
               --configs "realistic-predicted $FP8 --kv-attention backend" ;;
  full) decode full --context 32000 --batches 16,16,16,1,1 --configs full ;;
  fused) decode fused --context 32000 --batches 16,16,16,1,1 \
           --configs "realistic-predicted $FP8 --kv-attention fused" ;;
  fp8w) decode fp8w --context 32000 --batches 16,16,16,1,1 \
          --configs "realistic-predicted $FP8 --kv-attention fused --kv-early-weights fp8" ;;
  programs) for n in 48 64; do
              decode "programs-$n" --context 32000 --batches 16 \
                --configs "realistic-predicted $FP8 --kv-recall-programs $n"
            done ;;
  blocks) for n in 4 16; do
            decode "blocks-$n" --context 32000 --batches 16 --configs "realistic-predicted $FP8 --kv-recall-block $n"
          done ;;
  trace) decode trace --context 32000 --batches 16,1 --configs "realistic-predicted $FP8" --profile-steps 2
         cp /tmp/steps-trace/profile-*.txt "$OUT/" 2>/dev/null
         for b in 16 1; do
           for f in /tmp/steps-trace/trace-*-b$b/*.json*; do
             [ -e "$f" ] || continue
             python3 benchmarks/trace_layers.py "$f" > "$OUT/trace-layers-b$b.txt"  # whole: tee | head cut it
             head -n 16 "$OUT/trace-layers-b$b.txt"
             case $f in *.gz) cp "$f" "$OUT/trace-b$b.json.gz" ;; *) gzip -c "$f" > "$OUT/trace-b$b.json.gz" ;; esac
           done
         done ;;
  lanes) timeout $((LIMIT / 3)) python3 -m pytest -q -p no:cacheprovider tests/test_green_contexts.py \
           tests/engine/test_engine.py tests/engine/test_correct_at.py tests/kernels/test_channel_sketch.py \
           -k "green or graph_replay or test_channel_sketch" 2>&1 | tail -n 30 | tee "$OUT/lanes-tests.log"
         old=.ab/base/kernels/channel_sketch/triton.py  # the scoring kernel before session 53's unpack, if carried
         [ -f $old ] && timeout 120 python3 benchmarks/sketch_lse.py --shapes llama,qwen --batches 16,1 \
           --module $old --out "$OUT/sketch-lse.json" 2>&1 | tail -n 12 | tee "$OUT/sketch-lse.log"
         lanes() {  # lanes NAME SIDE_LANES_ARGS...
           local name=$1 t; shift
           t=$(left) || return 0
           timeout $t python3 benchmarks/side_lanes.py "$@" --out "$OUT/side-lanes-$name.json" 2>&1 \
             | tee -a "$OUT/side-lanes.log" | tail -n 10
         }
         lanes all --sms 0,16,24,32,48 --early 0.3
         for one in score chain recall; do lanes "$one" --lanes $one --sms 0,16,32; done
         lanes b1 --batch 1 --sms 0,16 --early 0.3 ;;
  thin) for lane in score chain recall; do thin "$lane" --lanes $lane; done
        thin score-w2 --lanes score --warps score=2
        thin chain-w4 --lanes chain --warps chain=4
        thin chain-w2 --lanes chain --warps chain=2
        thin recall-p16 --lanes recall --recall-programs 16
        thin recall-p64 --lanes recall --recall-programs 64
        thin recall-w2 --lanes recall --warps recall=2
        thin recall-w2-p64 --lanes recall --warps recall=2 --recall-programs 64
        thin all-thin --warps score=2,chain=4,recall=2 --early 0.3
        # the device brings back 8 files at most
        (cd "$OUT" && tar czf thin.tgz thin-*.json thin.log && rm -f thin-*.json thin.log) ;;
  copy) for via in kernel dma staged; do  # the recall's host pages through a copy engine (session 55, section 7)
          thin "recall-$via" --lanes recall --recall-via $via
          thin "all-$via" --early 0.3 --recall-via $via
        done
        thin recall-staged-p128 --lanes recall --recall-via staged --recall-programs 128
        thin all-staged-p128 --early 0.3 --recall-via staged --recall-programs 128
        thin b1-kernel --batch 1 --early 0.3
        thin b1-staged --batch 1 --early 0.3 --recall-via staged
        # the host's half: gathering each layer's chunks into one pinned run, by thread count
        t=$(left) && timeout $t python3 benchmarks/host_gather.py --arena-gb 8 --threads 1,2,4,8,16 \
          --out "$OUT/thin-host-gather.json" 2>&1 | tee -a "$OUT/thin.log" | tail -n 7
        (cd "$OUT" && tar czf copy.tgz thin-*.json thin.log && rm -f thin-*.json thin.log) ;;
  attn) timeout 240 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_fp8_linear.py \
          tests/kernels/test_split_attention.py tests/engine/test_engine.py tests/engine/test_launches.py \
          -k "fp8 or pages or fused or sm90 or launches" 2>&1 | tail -n 15 | tee "$OUT/attn-tests.log"
        for a in flashinfer pages; do thin "attn-$a" --attention $a --early 0.3; done  # the served paths beside the
        for n in 1 4 8; do thin "attn-pages-s$n" --attention pages --pages-splits $n --early 0.3; done  # side lanes
        for a in flashinfer pages; do thin "attn-b1-$a" --attention $a --early 0.3 --batch 1; done
        for b in 1 16; do  # the early lane's W_q in e4m3 (--kv-early-weights fp8), with the fused attention
          thin "attn-b$b-pages-fp8" --attention pages --early 0.3 --batch $b --early-weights fp8
        done
        (cd "$OUT" && tar czf attn.tgz thin-*.json thin.log && rm -f thin-*.json thin.log) ;;
  fp8) timeout 120 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_fp8_linear.py 2>&1 | tail -n 5 \
         | tee "$OUT/fp8-tests.log"
       timeout "$(left)" python3 benchmarks/fp8_linear.py --rows 1,4,16 --out "$OUT/fp8_linear.json" \
         2>&1 | tee "$OUT/fp8_linear.log" ;;
  score) decode score-132 --context 32000 --batches 16,16,16 \
           --configs "realistic-predicted $FP8 --kv-score-programs 132"
         decode speculate-attention --context 32000 --batches 16,16,16 \
           --configs "realistic-predicted $FP8 --kv-speculate-at attention" ;;
  default) decode default --context 32000 --batches 16,1 --configs "realistic-victim $FP8" ;;
  base) [ -f .ab/base/benchmarks/decode.py ] || { echo "no tree in .ab/base" >&2; exit 2; }
        ln -sfn "$PWD/.gpu-wheels" .ab/base/.gpu-wheels
        TREE=.ab/base decode base --context 32000 --batches 16 --configs "realistic-predicted $FP8" ;;
  long) decode long --context 120000 --batches 4 --configs "full,realistic-predicted $FP8" ;;  # session 49: arena 40
  long8) decode long8 --context 120000 --batches 4 --configs "realistic-predicted $FP8 --kv-early-weights fp8" ;;
  qwen) decode qwen --shape qwen2.5-7b --context 32000 --batches 16,16 \
          --configs "full,realistic-predicted $FP8 --kv-early-weights fp8" ;;  # the later --shape wins
  *) echo "usage: $0 predicted|full|fused|fp8w|programs|blocks|trace|lanes|thin|copy|attn|fp8|score|default|long|long8|qwen|base" >&2; exit 2 ;;
esac
