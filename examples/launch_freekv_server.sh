#!/usr/bin/env bash
# Launch an SGLang 0.5.16 server with FreeKV KV retrieval on one CUDA GPU.
#
#   MODEL=/path/to/hf-model bash examples/launch_freekv_server.sh [more sglang flags...]
#
# Then run the frontend examples against it:
#   python examples/long_document_qa.py --url http://127.0.0.1:30000
#   python examples/long_generation.py --url http://127.0.0.1:30000
#
# Needs `pip install -e .` in the environment that has sglang (the plugin registers itself through the
# `sglang.srt.plugins` entry point; nothing else to load). A smaller model for trying it out:
#   python -m freekv_sglang.hf_models export /tmp/smollm2 && MODEL=/tmp/smollm2 bash examples/launch_freekv_server.sh
set -euo pipefail

MODEL=${MODEL:?set MODEL to a Hugging Face model directory or id (an MHA/GQA model without sliding-window layers)}
PORT=${PORT:-30000}

args=(
  --model-path "$MODEL"
  --host 127.0.0.1 --port "$PORT"

  # Turn FreeKV on: decode attention reads only a fixed budget of KV pages per request and KV head.
  --kv-retrieval freekv
  # Tokens of pages *selected* per step (per KV head and request), on top of sink and window.
  --kv-budget 2048
  # The first tokens of every request, always attended.
  --kv-sink 128
  # The most recent tokens, always attended (plus the page being filled).
  --kv-window 512
  # Tokens per KV head and request of evicted pages kept on the GPU: a selection that returns to one copies it on the
  # GPU instead of recalling it from host memory (a real model's selection returns to 46-58% of its changed pages
  # with one budget of it). 0 (default) keeps none; 2048 cut a recall-bound 16 x 32K step by 13% on an H100, at
  # the GPU memory of a second budget per request (fewer requests fit).
  --kv-victim 0
  # Tokens per page: the unit of selection, offload and recall. SGLang's --page-size is set to it
  # (passing a different --page-size is refused).
  --kv-page-size 32
  # How host pages hold K and V: auto (the KV cache's dtype) or fp8_e4m3 (e4m3 values with a power-of-two scale per
  # token, KV head and K/V: the arena holds twice the tokens and recalls read half the bytes; recalled pages are
  # rounded to e4m3's 3-bit mantissa). fp8_e4m3 took 9.5% off a 16 x 32K step on an H200.
  --kv-host-dtype auto
  # Reselect a KV head's pages before attention when the cosine similarity of adjacent queries falls
  # below this (0 = always reuse the previous step's selection, 1 = reselect every step).
  --kv-correction-threshold 0.9
  # The first layers stay dense (attend over the whole context).
  --kv-dense-layers 1
  # Recall only the pages a reselection adds (delta); "all" recalls every selected page, an ablation.
  --kv-recall delta
  # GPU programs of the speculative recall, which reads host memory beside the model's GEMMs; each strides
  # over many pages so the recall does not take SMs from the GEMMs (0 = one program per page).
  --kv-recall-programs 32
  # Slots per GPU program of the recall before attention (0 = one program per request, KV head and slot; B blocks of
  # B slots, each recalled one page after another; slower at every B alone, docs/results/session48).
  --kv-recall-block 0
  # GPU programs of the channels selection's speculative scoring beside the GEMMs (0 = one per request, KV head and
  # chunk of pages; not yet measured in a served step, docs/results/session30).
  --kv-score-programs 0
  # Where a layer's speculative selection starts: "next_recall" (default) beside the next sparse layer's recall before
  # attention; "attention" right after the layer's attention, as the paper (same selections, other place in the step).
  --kv-speculate-at next_recall
  # Where the correction starts: "layer" (default) after the layer's QKV projection, as the paper; "previous_mlp" also
  # one layer early, from a query predicted off the previous layer's mid residual while its MLP runs, leaving the
  # check after the projection the heads the prediction missed (Llama/Qwen2 layers, unquantized; not yet timed on a GPU).
  --kv-correct-at layer
  # With --kv-correct-at previous_mlp(_only): "fp8" projects the predicted query from an e4m3 copy of each W_q made at
  # start-up (half the bytes the early lane reads each layer, ~0.5 GB on Llama-3.1-8B in the memory plan; sm_89+; one
  # request 4.5% faster on an H200, docs/results/session57); "model" (default) from the model's own.
  --kv-early-weights model
  # Sparse layers' attention: "fused" (default) through FreeKV's own kernel in one launch (on an H200 one request 6%
  # and sixteen 5% faster than "backend", docs/results/session57); "backend" through the attention backend's decode
  # kernel, exact as full KV when the budget covers the context (the only one with --enable-deterministic-inference);
  # "split" through FreeKV's own kernels beside the correction's recall (no faster, docs/results/session32).
  --kv-attention fused
  # How pages are scored: "channels" (default) as attention mass from 4-bit codes of --kv-sketch-channels key
  # channels (0: 32) that a calibration pass at start-up picks for the model, 16 GPU bytes per token and KV head,
  # accurate where one token of a page matters (a needle) at the cost of MeanS's step (docs/results/session24);
  # "sketch" from 2-bit codes of the channels each query weighs most (head_dim / 4 bytes; up to 18% longer steps);
  # "rerank" then rescores the sketch's best --kv-rerank-factor x budget pages from all their codes; "means" (the
  # paper's MeanS over min / max page summaries) misses needles; "quest" the max over the group of those bounds.
  --kv-selection channels
  --kv-sketch-channels 0
  # A reselection keeps a resident page unless another holds more than (1 + H) times its attention mass: pages at
  # the top-k's edge stop trading places on small query changes (half the recalls on SmolLM2, same scores; 0 = the
  # paper's plain top-k; default 1 for sketch, rerank and means).
  --kv-hysteresis 1
  # --kv-rerank-factor 2 (with --kv-selection rerank)
  # Benchmarks only, never to serve: --kv-bench-correction-rate R flags each check for correction with probability
  # R instead of by query similarity, and --kv-bench-churn S makes each selection replace a share S of the head's
  # pages at random (random-weight models have unrealistic query churn; benchmarks/decode.py --configs realistic);
  # --kv-bench-returns B (with --kv-victim) draws a share B of those pages from the evicted ones;
  # --kv-bench-late-correction-rate L (with --kv-correct-at previous_mlp, where R is then the early corrections' rate)
  # flags the check after the QKV projection with probability L.
  # --kv-retrieval louiskv instead retrieves only at semantic boundaries (the query's similarity to the previous
  # step's below --kv-boundary-threshold), prompt KV in k-means clusters of --kv-cluster-size keys (--kv-kmeans-iters
  # iterations), generated KV in segments of up to --kv-segment tokens; drop the FreeKV-only flags above with it
  # (--kv-correction-threshold, --kv-recall-programs, --kv-score-programs, --kv-speculate-at, --kv-correct-at,
  # --kv-early-weights, --kv-selection, --kv-rerank-factor, --kv-sketch-channels, --kv-hysteresis, --kv-bench-correction-rate,
  # --kv-bench-churn, --kv-bench-returns, --kv-bench-late-correction-rate).
  # A chunked prompt stays in staging until its last chunk, whose forward clusters it whole; it needs
  # --disable-radix-cache (README, LouisKV).
  # --kv-prefill tsp (FastKV's token-selective propagation after layer --kv-tsp-layer, keeping --kv-tsp-keep tokens)
  # runs with FreeKV or alone (without --kv-retrieval); it prefills each prompt whole (--chunked-prefill-size -1) and
  # is refused with the radix cache and prefill CUDA graphs (README, FastKV).
  # Host-memory budget (GiB) of the embedded kvstore daemon that holds every request's full KV cache.
  # It starts with the server and stops with it; it must fit in RAM and /dev/shm (containers: --shm-size).
  --kvstore-arena-gb "${ARENA_GB:-16}"
  # Or use a daemon that is already running (freekv-kvstore --endpoint ...) instead of an embedded one:
  # --kvstore-endpoint ipc:///run/freekv/kvstore.sock
  # Seconds a kvstore call waits for the daemon (resending meanwhile) before the requests that need it end with an
  # abort: at least the 2 s an embedded daemon's supervisor takes to restart it.
  --kvstore-timeout 5

  # SGLang's radix cache stays on: a cached prefix's full pages are shared as kvstore host pages (every layer, once)
  # and a hit skips their prefill (docs/radix.md; refused with --tp-size > 1 and with louiskv). To turn it off:
  # --disable-radix-cache
  # FreeKV wraps the triton or flashinfer backend (triton is chosen when no backend is named). With
  # flashinfer the sparse layers attend through FlashInfer's own decode kernel and, when the budget
  # covers the context, round exactly as full attention.
  --attention-backend flashinfer
)

# Refused with FreeKV (each with a message naming the flag): --speculative-algorithm, --enable-dp-attention,
# --enable-hierarchical-cache, --enable-hisparse, --enable-mixed-chunk, --disaggregation-mode prefill|decode,
# --pp-size > 1, --enable-two-batch-overlap, --enable-pdmux, attention backends other than triton/flashinfer,
# and MLA or sliding-window models.
exec python -m sglang.launch_server "${args[@]}" "$@"
