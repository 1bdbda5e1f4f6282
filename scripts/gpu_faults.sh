#!/usr/bin/env bash
# Issue 19's fault table on one GPU, after the SmolLM2 parts are on the machine (bash scripts/gpu_selection.sh
# stash with .gpu-model/1 carried, in an earlier call on the same warm machine):
#   bash scripts/gpu_faults.sh   (carry .gpu-model/2; the wheelhouse must already be unpacked in /tmp/site by an
#                                 earlier call that carried .gpu-wheels)
# Runs benchmarks/faults.py against FreeKV servers of SmolLM2; table on stdout, JSON and server logs under $OUT.
# Seven scenarios start seven servers (daemon-kill and daemon-stop share one), about 2.5 minutes a scenario (H100,
# session 13): run them in three calls, e.g.
#   bash scripts/gpu_faults.sh --deterministic --scenarios daemon-kill,daemon-stop,daemon-gone
#   bash scripts/gpu_faults.sh --scenarios daemon-lost,server-restart
#   bash scripts/gpu_faults.sh --scenarios arena-full,malformed
# MODEL=dummy runs SmolLM2's shapes with random weights (--load-format dummy): no model transfer, one call less;
# greedy outputs still depend on the cached KV, so equality with the undisturbed run still checks it (less sharply
# than a real model's: random weights may repeat a token); carry .gpu-wheels only.
# Rows print as each scenario ends; the run's folder (faults.json, server and daemon logs) comes back as one
# $OUT/faults-HHMMSS.tgz, since a call returns at most 8 files. --deterministic (SGLang's deterministic inference) makes
# the greedy outputs comparable with the undisturbed run.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results}; mkdir -p "$OUT"
source scripts/gpu_env.sh || exit 1
pkill -9 -f sglang.launch_server 2>/dev/null; pkill -9 -f freekv_kvstore 2>/dev/null; sleep 1
if [ "${MODEL:-smollm2}" = dummy ]; then  # SmolLM2's shapes with random weights: no model transfer
  python3 scripts/make_dummy_model.py smollm2-135m /tmp/smollm2-dummy >/dev/null || exit 1
  MODEL_ARGS=(--model-path /tmp/smollm2-dummy --model-args "--load-format dummy --tokenizer-path /tmp/smollm2-dummy/tokenizer")
else
  bash scripts/gpu_smollm2.sh build >/dev/null || exit 1
  MODEL_ARGS=(--model-path /tmp/smollm2)
fi
RUN=/tmp/faults-run; rm -rf "$RUN"
python3 benchmarks/faults.py "${MODEL_ARGS[@]}" --out "$RUN" "$@" 2>&1 | grep -v "it/s\]"
tar czf "$OUT/faults-$(date +%H%M%S).tgz" -C "$RUN" .
