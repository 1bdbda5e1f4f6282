#!/usr/bin/env bash
# Issue 20, deliverable 4: radix prefix sharing on a random-weight Llama-3.1-8B shape. Three servers in turn:
#   freekv-radix   FreeKV with SGLang's radix cache (prefixes shared as kvstore host pages, docs/radix.md)
#   freekv-plain   FreeKV with --disable-radix-cache
#   full-radix     plain SGLang (full KV on the GPU) with its radix cache
# Each: one warm-up request (a 32K prefix + 256 tokens) caches the prefix; then the TTFT of a miss (a new 32K prompt)
# and of a hit (the prefix + 256 new tokens), a sharer sent 0.5 s into another new 32K prompt's prefill (it hits the
# chunks exported so far: SGLang's cached_tokens), then 16 concurrent requests sharing the prefix (256 unique tokens each,
# 64 greedy tokens): their TTFT and decode step (TPOT), and for FreeKV the kvstore arena's pages (an external daemon
# polled during the burst: used = held by requests, cached = held only by retained prefixes).
# HITS=N more hits after the first (default 4; the ratio takes their median); PROFILE_HIT=1 profiles one more hit
# (SGLang's /start_profile, summarised by benchmarks/trace_summary.py into radix-NAME-hit-profile.txt).
# HOST_DTYPE: FreeKV's --kv-host-dtype (default fp8_e4m3, as benchmarks/decode.py's cells; auto: the KV cache's bf16,
# which doubles a hit's fill of its prefix from host pages).
# Fits one 10-minute device call. Needs /tmp/site (the wheelhouse). Usage: [RUNS=a,b] bash scripts/gpu_radix.sh [BACKEND]
# (RUNS: which of the three servers, in order; default all). The arena holds 16 unshared 32K prompts (freekv-plain).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results}; mkdir -p "$OUT"
source scripts/gpu_env.sh || exit 1
BACKEND=${1:-flashinfer} RUNS=${RUNS:-freekv-radix,freekv-plain,full-radix}
rm -rf /tmp/llama8b; python3 scripts/make_dummy_model.py llama-3.1-8b /tmp/llama8b >/dev/null || exit 1
PORT=30003 KV=ipc:///tmp/fkv-radix.sock
COMMON=(--model-path /tmp/llama8b --load-format dummy --port $PORT --attention-backend "$BACKEND" --page-size 32
        --sampling-backend pytorch --grammar-backend none --context-length 34000 --max-running-requests 16
        --chunked-prefill-size 8192 --mem-fraction-static 0.6)
FREEKV=(--kv-retrieval freekv --kv-budget 2048 --kv-sink 128 --kv-window 512 --kv-page-size 32
        --kvstore-endpoint $KV --kvstore-arena-gb 72 --kv-host-dtype "${HOST_DTYPE:-fp8_e4m3}")

setsid python3 -m freekv_kvstore --endpoint $KV --arena-gb 74 >"$OUT/radix-kvstore.log" 2>&1 &
DPID=$!
trap 'kill -TERM -- -$DPID 2>/dev/null' EXIT

run() {  # run NAME ARGS...
  local name=$1; shift
  FREEKV_STATS_EVERY=256 setsid python3 -m sglang.launch_server "${COMMON[@]}" "$@" >"$OUT/server-radix-$name.log" 2>&1 &
  local spid=$!
  wait_healthy "$name" $PORT $spid "$OUT/server-radix-$name.log" 240 || return 1
  timeout 200 python3 - "$name" "$PORT" "$KV" "$OUT" <<'EOF'
import concurrent.futures as cf, json, os, random, sys, threading, time, urllib.request
sys.path.insert(0, "benchmarks")
from serve_load import one_request
name, port, kv, out = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
url = f"http://127.0.0.1:{port}"
rng = random.Random(0)
ids = lambda n: [rng.randrange(100, 128000) for _ in range(n)]
prefix = ids(32768)
req = lambda prompt, n=1: one_request(url, prompt, n, 600)
res = {"name": name, "warmup": req(prefix + ids(256)), "miss": req(ids(32768 + 256)), "hit": req(prefix + ids(256))}
# More hits, one at a time (each its own 256 new tokens): the ratio uses their median, not one sample.
res["hits"] = [req(prefix + ids(256)) for _ in range(int(os.environ.get("HITS", "4")))]
hit_ttfts = sorted(r["ttft_s"] for r in [res["hit"]] + res["hits"] if r["ok"])
res["hit_ttft_median_s"] = hit_ttfts[len(hit_ttfts) // 2] if hit_ttfts else float("nan")
if os.environ.get("PROFILE_HIT") == "1":  # one more hit under SGLang's torch profiler (summarised after the run)
    post = lambda path, body: urllib.request.urlopen(urllib.request.Request(
        url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}), timeout=120).read()
    post("/start_profile", {"output_dir": f"/tmp/trace-{name}", "activities": ["CPU", "GPU"], "with_stack": True})
    res["profiled_hit"] = req(prefix + ids(256))
    post("/stop_profile", {})
# A sharer sent while a new 32K prompt is still prefilling (chunks of 8192): it hits the chunks exported so far.
second = ids(32768)
with cf.ThreadPoolExecutor(2) as ex:
    first = ex.submit(req, second + ids(256))
    time.sleep(0.5)
    res["mid_prefill_sharer"] = req(second + ids(256))
    res["mid_prefill_first"] = first.result()
arena = []
def poll(stop):
    if not name.startswith("freekv"):
        return
    from freekv_kvstore import daemon_stats
    while not stop.is_set():
        for a in daemon_stats(kv).arenas:
            arena.append({"used_pages": a.used_pages, "cached_pages": a.cached_pages, "page_bytes": a.page_bytes})
        time.sleep(0.2)
stop = threading.Event(); t = threading.Thread(target=poll, args=(stop,)); t.start()
with cf.ThreadPoolExecutor(16) as ex:
    burst = list(ex.map(lambda _: req(prefix + ids(256), 64), range(16)))
stop.set(); t.join()
ok = [r for r in burst if r["ok"]]
res["burst"] = {"ok": len(ok), "ttft_s_mean": sum(r["ttft_s"] for r in ok) / max(len(ok), 1),
                "tpot_s_mean": sum(r["tpot_s"] for r in ok) / max(len(ok), 1), "errors": [r.get("error") for r in burst if not r["ok"]]}
if arena:
    peak = max(arena, key=lambda a: a["used_pages"] + a["cached_pages"])
    res["arena_peak_gb"] = (peak["used_pages"] + peak["cached_pages"]) * peak["page_bytes"] / 1e9
    res["arena_peak_pages"] = peak
mid = res["mid_prefill_sharer"]
print(f"{name}: sharer sent 0.5 s into a 32K prefill: TTFT {mid.get('ttft_s', float('nan')):.3f} s, "
      f"{mid.get('cached_tokens')} tokens cached (the first: {res['mid_prefill_first'].get('ttft_s', float('nan')):.3f} s)")
print(f"{name}: TTFT miss {res['miss'].get('ttft_s', float('nan')):.3f} s, hit {res['hit'].get('ttft_s', float('nan')):.3f} s "
      f"(median of {len(hit_ttfts)} hits {res['hit_ttft_median_s']:.3f} s: {[round(t, 3) for t in hit_ttfts]}; "
      f"miss / median hit {res['miss'].get('ttft_s', float('nan')) / res['hit_ttft_median_s']:.1f}x) "
      f"({res['hit'].get('cached_tokens')} tokens cached); "
      f"16 sharers: TTFT {res['burst']['ttft_s_mean']:.3f} s, decode step {res['burst']['tpot_s_mean'] * 1e3:.2f} ms, "
      f"{res['burst']['ok']}/16 ok; arena peak {res.get('arena_peak_gb', 0):.2f} GB")
json.dump(res, open(f"{out}/radix-{name}.json", "w"), indent=1)
EOF
  local rc=$?
  if [ "${PROFILE_HIT:-0}" = 1 ]; then  # the trace is written after stop_profile returns
    for _ in $(seq 60); do ls /tmp/trace-$name/*.json* >/dev/null 2>&1 && break; sleep 2; done; sleep 5
    for t in /tmp/trace-$name/*.json*; do
      python3 benchmarks/trace_summary.py "$t" >"$OUT/radix-$name-hit-profile.txt" 2>&1; head -c 6000 "$OUT/radix-$name-hit-profile.txt"
    done
  fi
  grep -E "FreeKV rank|Traceback|Error" "$OUT/server-radix-$name.log" | tail -n 4
  kill -TERM -- -$spid 2>/dev/null; sleep 3; kill -9 -- -$spid 2>/dev/null
  return $rc
}

for name in ${RUNS//,/ }; do
  case $name in
    freekv-radix) run freekv-radix "${FREEKV[@]}" ;;
    freekv-plain) run freekv-plain "${FREEKV[@]}" --disable-radix-cache ;;
    full-radix) run full-radix ;;
    *) echo "unknown run $name (RUNS: freekv-radix, freekv-plain, full-radix)"; exit 2 ;;
  esac
done
