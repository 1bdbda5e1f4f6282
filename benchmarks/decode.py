"""Decode speed of FreeKV inside SGLang against full-KV SGLang, measured in one run on one GPU.

    python3 benchmarks/decode.py --shape llama-3.1-8b --context 32000 --batches 1,4,8 \
        --configs full,freekv,tau0,tau1,recall-all --out results/decode

For each server configuration: build a random-weight model of the shape (scripts/make_dummy_model.py,
--load-format dummy), launch SGLang (FlashInfer, CUDA graphs on, page 32, the radix cache on as a server's default
unless --radix-cache off; the prompts are random, so nothing hits), send one untimed warm-up request
(--warmup-tokens, plus one prefill chunk when the context is chunked: the first request otherwise pays Triton's
compilation of FreeKV's kernels, and the first chunk with a prefix FlashInfer's build of its cascade module), and
for each batch B send B requests of `context` random tokens at once (streamed, greedy, `output_len` new tokens).
Per cell: the decode step time (the span in which the whole batch decodes, per token), its median step and its
first step (from the token stamps: the mean also carries one-off steps, the first decode step's and the finishing
one's), TPOT p50 (which also counts stalls while the batch's later requests prefill), output throughput, TTFT p50,
and for FreeKV the correction rate, the pages changed per step (recalled or from the victim cache) and the recall
GB/s during decode (engine_window: the server's FreeKV log lines, cumulative every 32 steps, differenced between two
of them logged while the whole batch decoded), beside the host-to-GPU copy peak measured by this script on the same GPU.
Also, from each server's start-up lines (allocated tensors): its token pool, the GPU KV bytes per decoding
request, and the most concurrent requests of this context it holds before queueing (FreeKV: the kvstore arena's
tokens, at most one per request slot).

Configurations (FreeKV: budget 2048, sink 128, window 512 unless --freekv-args says otherwise):
  full        plain SGLang, full KV on the GPU (the baseline)
  freekv      FreeKV, tau 0.9, delta recall
  tau0        pure speculation (tau 0): no correction recall before attention
  tau1        no speculation (tau 1): every head reselected and recalled before attention
  recall-all  speculation without delta recall (--kv-recall all)
  realistic   a real model's correction and churn replayed (--kv-bench-correction-rate 0.3 --kv-bench-churn 0.15)
  realistic-victim  the same with a victim cache of 2048 tokens (--kv-victim 2048), half the churn returning to it
              (--kv-bench-returns 0.5; a real model's share: 0.46-0.58)
  realistic-victim2 / realistic-victim4  two / four budgets of victims (4096 / 8192 tokens), 0.6 / 0.65 of the churn
              returning (a real model's share: 0.55-0.67 / 0.60-0.70)
  realistic-early  realistic-victim with --kv-correct-at previous_mlp: the 0.3 corrected one layer early, 0.05 of
              the checks left after the QKV projection (--kv-bench-late-correction-rate 0.05; SmolLM2-135M: 0.048-0.056)
  realistic-predicted  realistic-victim with --kv-correct-at previous_mlp_only: the 0.3 corrected one layer early,
              nothing of the correction on the critical path
  long-input-victim  realistic-victim at the paper's long-input setting: tau 0.8 (--kv-correction-threshold 0.8; the
              server default, 0.9, is the paper's long-generation one) and its correction rate replayed, 0.14
              (FreeKV's paper, Table 9, LongBench v2 at tau 0.8: Llama-3.1-8B 0.14, Qwen2.5-7B 0.09; SmolLM2-135M
              0.13-0.16 by benchmarks/churn.py)
A configuration may add server flags after its name, e.g. --configs "full,freekv,freekv --kv-recall-programs 0".
--profile-steps N: SGLang's profiler (/start_profile, GPU activity only) over N decode steps of each batch, started
once the server logs a decode batch with every request of the batch running; benchmarks/trace_summary.py writes
profile-CONFIG-bB.txt from the trace: kernels by total time and each GPU stream's busy time per step. With
--profile-cpu also CPU activity with Python stacks, which slows the host: the blocking calls by caller show whether a
step's host preparation waits for the device.
--profile-first N: the same profiler, CPU and GPU with Python stacks, from the moment each batch is sent over its first
N forwards (the scheduler's wait for the requests, their matching and the first prefills): first-CONFIG-bB.txt. It
slows the host, so that batch's TTFT is not a measurement.
Each server compiles Triton kernels into a cache directory of its own (with --triton-cache, one shared by every
server and run, which a later server loads from); `jit` lists the kernels it compiled while a timed batch ran (none
once the warm-up compiled what serving needs: a compilation on a request's path delays it).
`jit_modules` lists the FlashInfer and SGLang (tvm-ffi) modules built while it ran. Their caches are shared by the
run's servers, so whichever server needs a module first builds it: before session 40 the warm-up ran no chunk with a
prefix, and at 120K the first server paid ~8 s of FlashInfer's cascade build in its first TTFT.
Random weights make adjacent queries nearly uncorrelated, so at tau 0.9 almost every head is flagged;
tau0 and tau1 bracket what a real model's correction rate gives. Random keys also churn unrealistically: without
hysteresis near-equal pages trade places every step, with it (the default) almost none do, where SmolLM2's real
selection changes 0.15 of its budget per step (benchmarks/churn.py). `realistic` replays both: each (request, KV
head) check is flagged with probability 0.3 (--kv-bench-correction-rate; FreeKV's paper: 0.04-0.14 on Llama-3.1-8B
at tau 0.8, 0.17-0.43 at 0.9) and each selection replaces 0.15 of the head's pages at random (--kv-bench-churn;
scoring still runs). The corr column reports the correction rate the server measured, `changed` the share of the
budget's pages recalled per request, step, sparse layer and KV head (from the recalled bytes).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from freekv_kvstore import ArenaGeometry

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_load import one_request
from server_process import ServerProcess

ROOT = Path(__file__).resolve().parent.parent
# A real model's costs on random weights: the correction rate in the middle of FreeKV's paper's Llama-3.1-8B range at
# tau 0.9 (0.17-0.43) and SmolLM2-135M's changed share per step with the default selection.
REALISTIC = ["--kv-retrieval", "freekv", "--kv-bench-correction-rate", "0.3", "--kv-bench-churn", "0.15"]
CONFIGS = {
    "full": [],
    "freekv": ["--kv-retrieval", "freekv"],
    "tau0": ["--kv-retrieval", "freekv", "--kv-correction-threshold", "0"],
    "tau1": ["--kv-retrieval", "freekv", "--kv-correction-threshold", "1"],
    "recall-all": ["--kv-retrieval", "freekv", "--kv-recall", "all"],
    "realistic": REALISTIC,
    # The same with a victim cache of one budget, and the share of the churn a real model's selection takes back
    # from such a cache: 0.58 on SmolLM2-135M, 0.46 on Qwen2.5-Coder-0.5B (benchmarks/churn.py, victim_hit_1).
    "realistic-victim": [*REALISTIC, "--kv-victim", "2048", "--kv-bench-returns", "0.5"],
    # Two and four budgets of victims, with the shares the same models take back from them (victim_hit_2: 0.67 /
    # 0.55, victim_hit_4: 0.70 / 0.60; docs/results/session37): fewer host bytes for more GPU pages per request.
    "realistic-victim2": [*REALISTIC, "--kv-victim", "4096", "--kv-bench-returns", "0.6"],
    "realistic-victim4": [*REALISTIC, "--kv-victim", "8192", "--kv-bench-returns", "0.65"],
    # FreeKV's paper runs its long-input efficiency benchmark (32K in, 512 out) at tau 0.8, where its Table 9 measures
    # a correction rate of 0.14 on Llama-3.1-8B and 0.09 on Qwen2.5-7B (LongBench v2): the larger one for both shapes.
    "long-input-victim": ["--kv-retrieval", "freekv", "--kv-correction-threshold", "0.8", "--kv-bench-correction-rate",
                          "0.14", "--kv-bench-churn", "0.15", "--kv-victim", "2048", "--kv-bench-returns", "0.5"],
    # realistic-victim with the correction one layer early: the same 0.3 corrected while the previous layer's MLP runs,
    # and 0.05 of the checks left to correct after the QKV projection (SmolLM2-135M: 0.048-0.056; session 50).
    "realistic-early": [*REALISTIC, "--kv-victim", "2048", "--kv-bench-returns", "0.5", "--kv-correct-at",
                        "previous_mlp", "--kv-bench-late-correction-rate", "0.05"],
    # The same 0.3 corrected one layer early and nothing after the QKV projection (--kv-correct-at previous_mlp_only).
    # Replayed, the heads corrected early select again after attention, as served, at a churn of 0 (since session
    # 52; before, they skipped that selection, which understated the speculate lane's scoring by up to 0.3 of it;
    # the same holds for realistic-early). It understates the early lane's work: on SmolLM2-135M (CPU, passkey /
    # multikey 8K, session 51) this mode flagged 0.570-0.576 of the checks where the paper's check flags
    # 0.492-0.500, i.e. ~0.35 against this 0.3.
    "realistic-predicted": [*REALISTIC, "--kv-victim", "2048", "--kv-bench-returns", "0.5", "--kv-correct-at",
                            "previous_mlp_only"],
}
STATS = re.compile(r"FreeKV rank 0: (\d+) decode steps, correction rate ([\d.]+) .*recall ([\d.]+) GB before "
                   r"attention \+ ([\d.]+) GB speculative(?:, victim cache (\d+) \+ (\d+) pages)?"
                   r"(?:; (\d+) checks, (\d+) flagged, (\d+) \+ (\d+) pages recalled)?(?:, (\d+) flagged early)?")
HOST = re.compile(r"(\d+) host pages \(([\d.]+) GB\)")
KV_ALLOC = re.compile(r"KV Cache is allocated\. dtype: \S+, #tokens: (\d+), K size: ([\d.]+) GB, V size: ([\d.]+) GB")
ROOM = re.compile(r"request slots \(room for (\d+)\)")
PLAN = re.compile(r"dense layers ([\d.]+) GB \+ staging (\d+) pages ([\d.]+) GB")
ENGINE = re.compile(r"engine GPU memory ([\d.]+) GB for (\d+) request slots(?: \(page summaries ([\d.]+) GB\))?")
PAGE = re.compile(r"FreeKVConfig\(.*?page_size=(\d+)")
DECODE_LOG = re.compile(r"Decode batch.*?#running-req: (\d+),.*?cuda graph: (\w+).*?#queue-req: (\d+)")


def memory_cell(log: str, context: int) -> dict:
    """GPU KV memory from the server's own start-up lines (allocated tensors, not formulas): SGLang's pool, and
    under FreeKV its split and the engine's pages. Per decoding request: full KV holds `context` tokens in the
    pool; FreeKV holds its dense layers' `context` tokens in the pool, one engine slot's pages and the summaries of
    its own pages (servers that log the summaries' size; older lines give the engine's bytes per slot). Most concurrent
    requests of this context before queueing: what the token pool holds, and under FreeKV at most as many as the
    GPU has room for request slots (whatever --max-running-requests this run passed)."""
    kv, room = KV_ALLOC.search(log), ROOM.search(log)
    if not kv:
        return {}
    tokens, pool_gb = int(kv.group(1)), float(kv.group(2)) + float(kv.group(3))
    cell = {"gpu_pool_tokens": tokens, "gpu_pool_gb": pool_gb, "max_concurrent": tokens // context}
    plan, engine = PLAN.search(log), ENGINE.search(log)
    if plan and engine:
        dense_gb, engine_gb, slots = float(plan.group(1)), float(engine.group(1)), int(engine.group(2))
        per_slot = engine_gb / slots
        host, page = HOST.search(log), PAGE.search(log)
        if engine.group(3) and host and page:
            # Summaries cover every arena page; a request's share is its own pages' (one slot absorbs padding).
            summaries_gb = float(engine.group(3))
            per_slot = (engine_gb - summaries_gb) / slots + summaries_gb * -(-context // int(page.group(1))) / int(
                host.group(1))
        cell.update(staging_gb=float(plan.group(3)), engine_gb=engine_gb, request_slots=slots,
                    kv_gb_per_request=round(dense_gb / tokens * context + per_slot, 4))
        if room:
            cell["max_concurrent"] = min(cell["max_concurrent"], int(room.group(1)))
    else:
        cell["kv_gb_per_request"] = round(pool_gb / tokens * context, 4)
    return cell


def log_since(log: Path, offset: int) -> str:
    """A server log past `offset` bytes: what it wrote while one cell ran."""
    with open(log, errors="replace") as f:
        f.seek(offset)
        return f.read()


def scheduler_cell(text: str) -> dict:
    """What SGLang's scheduler logged while a batch ran (text: log_since the cell's start): the most requests
    decoding at once, the longest waiting queue, whether every decode step replayed a CUDA graph, and how often it
    retracted requests (KV pool full)."""
    lines = DECODE_LOG.findall(text)
    if not lines:
        return {}
    return {"max_running": max(int(r) for r, _, _ in lines), "max_queued": max(int(q) for _, _, q in lines),
            "cuda_graph": all(g == "True" for _, g, _ in lines), "retractions": text.count("Retract")}


def max_running_requests(given: int, batches: list[int], context: int, chunk: int) -> int:
    """--max-running-requests of every server: `given`, else the largest batch, plus one slot when a prompt
    takes several prefill chunks. SGLang 0.5.16 counts a chunked prompt twice, in the prefill batch and among
    the held request slots (Scheduler.get_num_allocatable_reqs): while the last free slot's prompt is chunked it
    marks the batch full, and the last request of a batch waits until another finishes (seen at 128K: 3 of 4
    decoding, one queued, under both full KV and FreeKV; upstream sgl-project/sglang#35537)."""
    if given:
        return given
    return max(batches) + (context > chunk)


def copy_peak_gbps() -> float:
    """Pinned host -> GPU copy_ of 2 GiB, best of 5: the link's practical peak."""
    import torch

    src = torch.empty(2 << 30, dtype=torch.uint8).pin_memory()
    dst = torch.empty_like(src, device="cuda")
    best = 0.0
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        best = max(best, src.numel() / (time.perf_counter() - t0) / 1e9)
    del src, dst
    torch.cuda.empty_cache()
    return best


def run_batch(url: str, batch: int, context: int, output_len: int, vocab: int, seed: int) -> dict:
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, vocab) for _ in range(context)] for _ in range(batch)]
    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(batch) as ex:
        results = list(ex.map(lambda p: one_request(url, p, output_len, 1800), prompts))
    wall = time.perf_counter() - t0
    ok = [r for r in results if r["ok"]]
    out = {"batch": batch, "completed": len(ok), "errors": [r["error"] for r in results if not r["ok"]],
           "wall_s": round(wall, 2)}
    return {**out, **batch_figures(ok, output_len)} if ok else out


DECODE_LINE = re.compile(r"Decode batch[^#\n]*#running-req: (\d+)")


def profile_when_decoding(url: str, log: Path, offset: int, batch: int, steps: int, trace_dir: Path,
                          timeout: float = 1800, cpu: bool = False) -> threading.Thread:
    """A thread that starts SGLang's profiler for `steps` steps once the log (past offset) shows a decode batch
    with `batch` requests running: the profiler then sees the batch's decode, not its prefills."""
    def watch():
        t0 = time.time()
        while time.time() - t0 < timeout:
            with open(log, errors="replace") as f:
                f.seek(offset)
                if any(int(n) >= batch for n in DECODE_LINE.findall(f.read())):
                    start_profile(url, trace_dir, steps, ["CPU", "GPU"] if cpu else ["GPU"], with_stack=cpu)
                    return
            time.sleep(0.2)
    t = threading.Thread(target=watch, daemon=True)
    t.start()
    return t


def start_profile(url: str, trace_dir: Path, steps: int, activities: list[str], with_stack: bool = False) -> None:
    body = {"output_dir": str(trace_dir), "num_steps": steps, "activities": activities, "with_stack": with_stack}
    urllib.request.urlopen(urllib.request.Request(url + "/start_profile", json.dumps(body).encode(),
                                                  {"Content-Type": "application/json"}), timeout=60)


def triton_kernels(cache: Path) -> set[str]:
    """The compiled kernels in a Triton cache directory, as <entry>/<kernel name>: one entry per variant."""
    return {f"{f.parent.name}/{f.stem}" for f in cache.glob("*/*.json") if not f.name.startswith("__grp__")}


def jit_caches() -> list[Path]:
    """The on-disk caches of FlashInfer's and SGLang's (tvm-ffi) JIT builds. Unlike Triton's, every server of a run
    shares them: the first server to need a module builds it (e.g. FlashInfer's cascade module for the first prompt
    with a prefix chunk, ~8 s on an H200) and the later ones load it."""
    home = Path.home()
    return [Path(os.environ.get("FLASHINFER_WORKSPACE_BASE", home)) / ".cache" / "flashinfer",
            Path(os.environ.get("TVM_FFI_CACHE_DIR", home / ".cache" / "tvm-ffi"))]


def jit_modules(roots: list[Path]) -> set[str]:
    """The shared libraries built under JIT cache roots, as paths below their root."""
    return {f"{root.name}/{f.relative_to(root)}" for root in roots if root.is_dir() for f in root.glob("**/*.so")}


def warmup_length(context: int, warmup_tokens: int, chunk: int) -> int:
    """The warm-up prompt's tokens: warmup_tokens, or when the timed prompts are chunked (context > chunk) one chunk
    more, so that a prefill chunk with a prefix runs before them (FlashInfer builds its cascade module then)."""
    return min(context, warmup_tokens + (chunk if 0 < chunk < context else 0))


def summarize_trace(trace_dir: Path, steps: int, out: Path, wait_s: float = 120, top: int = 25) -> str:
    """trace_summary.py over the trace the profiler writes after its last step."""
    t0 = time.time()
    while time.time() - t0 < wait_s:
        traces = sorted(trace_dir.glob("*.json*"))
        if traces:
            time.sleep(5)  # written after the file appears
            r = subprocess.run([sys.executable, str(ROOT / "benchmarks/trace_summary.py"), str(traces[-1]),
                                "--steps", str(steps), "--top", str(top)], capture_output=True, text=True)
            out.write_text(r.stdout + r.stderr)
            return str(out)
        time.sleep(2)
    return f"no trace in {trace_dir} after {wait_s:.0f} s"


def batch_figures(ok: list[dict], output_len: int) -> dict:
    """Figures of the requests that completed (sent at once, so their times share an origin). The decode span
    runs from the last first token to the last token; `decoding_together` counts the requests still decoding
    when it begins: fewer than the batch (long prompts prefill one after another while earlier requests finish
    their output) means step_ms and tok/s are not a decode step of this batch."""
    last_first = max(r["ttft_s"] for r in ok)
    decode_s = max(r["latency_s"] for r in ok) - last_first
    return {
        "tpot_ms_p50": round(1000 * statistics.median(r["tpot_s"] for r in ok), 3),
        "ttft_s_p50": round(statistics.median(r["ttft_s"] for r in ok), 3),
        **ttft_spread([r["ttft_s"] for r in ok]),
        "decode_s": round(decode_s, 3),
        "decoding_together": sum(r["latency_s"] > last_first for r in ok),
        # TPOT p50 counts the stalls while later requests of the batch prefill; this is the pure decode step.
        "step_ms": round(1000 * decode_s / max(output_len - 1, 1), 3),
        "output_tok_per_s": round(len(ok) * (output_len - 1) / max(decode_s, 1e-9), 1),
        **step_timeline(ok, last_first),
    }


def ttft_spread(ttfts: list[float]) -> dict:
    """Prompts sent at once prefill one after another: the first request's TTFT is the server's delay before it starts
    (queueing, hashing, any one-time work) plus one prefill, and the median gap between consecutive TTFTs is one
    prefill. The median TTFT mixes both."""
    t = sorted(ttfts)
    gaps = [b - a for a, b in zip(t, t[1:])]
    return {"ttft_first_s": round(t[0], 3), "ttft_gap_s": round(statistics.median(gaps), 3) if gaps else None}


def step_timeline(ok: list[dict], last_first: float) -> dict:
    """The decode span step by step, from the token stamps: step k ends at the k-th token each request receives
    after the last first token; its length is the median over requests of that token's gap to the one before (the
    span's start for k = 1). step_ms is the mean, so a few slow steps (the first one's recall of every selection,
    host syncs) move it where the median does not. {} without stamps."""
    if not all("stamps_s" in r for r in ok):
        return {}
    runs = [[last_first] + [t for t in r["stamps_s"] if t > last_first] for r in ok]
    steps = min(len(s) for s in runs) - 1
    if steps < 1:
        return {}
    gaps = [1000 * statistics.median(s[k] - s[k - 1] for s in runs) for k in range(1, steps + 1)]
    slowest = sorted(range(steps), key=lambda k: -gaps[k])[:5]
    return {"step_ms_p50": round(statistics.median(gaps), 3), "first_step_ms": round(gaps[0], 3),
            "slowest_steps": [[k + 1, round(gaps[k], 2)] for k in sorted(slowest)],
            "step_gaps_ms": [round(g, 2) for g in gaps]}


STATS_EVERY = 32  # FREEKV_STATS_EVERY of the servers (each line a step or two after its counters' copy, which waits
# for nothing); decode lines come every 40 steps, and a 128-step batch then holds at least two stats lines after its
# first full decode line


def engine_window(text: str, batch: int) -> dict:
    """FreeKV's counters while a cell's whole batch decoded, from the cell's log text: of the stats lines (cumulative,
    every STATS_EVERY steps, exact counts at their end) those logged after a decode line that shows `batch` running
    requests, the first and the last, differenced. (The last lines before and after the cell would also count a
    neighbouring cell's steps: stats lines do not fall on a cell's edges.) Per check, one (request, sparse layer,
    KV head) step, so the few steps with fewer requests (staggered prefills and finishes) weigh as they ran. {}
    without two such lines."""
    running, inside = None, []
    for line in text.splitlines():
        decode = DECODE_LOG.search(line)
        if decode:
            running = int(decode.group(1))
            continue
        stats = STATS.search(line)
        if stats and running == batch and stats.group(7) is not None:
            inside.append([float(x or 0) for x in stats.groups()])
    if len(inside) < 2 or inside[-1][6] <= inside[0][6]:
        return {}
    d = [b - a for a, b in zip(inside[0], inside[-1])]
    # With --kv-correct-at previous_mlp the correction rate is the late checks', on the critical path.
    return {"window_checks": int(d[6]), "correction_rate": round(d[7] / d[6], 4),
            "early_correction_rate": round(d[10] / d[6], 4),
            "recall_pages_per_check": round((d[8] + d[9]) / d[6], 4),
            "victim_pages_per_check": round((d[4] + d[5]) / d[6], 4)}


def page_bytes(model: dict, args: list[str]) -> int:
    """K and V of one KV head's page as the host arena holds them (the bytes the link carries): a one-layer, one-head
    arena page of the servers' bf16 KV cache, or of --kv-host-dtype's (FP8 rows' exponents included)."""
    head_dim = model.get("head_dim") or model["hidden_size"] // model["num_attention_heads"]
    host = args[args.index("--kv-host-dtype") + 1] if "--kv-host-dtype" in args else "auto"
    return ArenaGeometry(1, 1, flag(args, "--kv-page-size", 32), head_dim,
                         "bfloat16" if host == "auto" else host).page_bytes


def flag(args: list[str], name: str, default: int) -> int:
    return int(args[args.index(name) + 1]) if name in args else default


def changed_share(cell: dict, args: list[str]) -> float | None:
    """Pages recalled per (request, sparse layer, KV head) step, over the budget's pages: the selection's churn
    (speculative and corrected together, from the host or the victim cache), from engine_window's counts."""
    if "recall_pages_per_check" not in cell:
        return None
    pages = flag(args, "--kv-budget", 2048) // flag(args, "--kv-page-size", 32)
    return round((cell["recall_pages_per_check"] + cell["victim_pages_per_check"]) / pages, 4)


def recall_gbps(cell: dict, args: list[str], model: dict) -> float | None:
    """The link's recall bytes per second of decode: engine_window's pages per check x the batch's checks per step
    / the step time."""
    if "recall_pages_per_check" not in cell or not cell.get("step_ms"):
        return None
    checks = cell["batch"] * (model["num_hidden_layers"] - flag(args, "--kv-dense-layers", 1)) * \
        model["num_key_value_heads"]
    return round(cell["recall_pages_per_check"] * checks * page_bytes(model, args) / cell["step_ms"] / 1e6, 2)


def print_table(result: dict) -> None:
    full = {c["batch"]: c for c in result["cells"] if c["config"] == "full" and "step_ms" in c}
    print(f"\n{result['gpu']}, {result['shape']}, context {result['context']}, {result['output_len']} new tokens; FreeKV {result['freekv_args']}")
    print(f"{'config':<16} {'batch':>5} {'step ms':>8} {'x full':>7} {'p50 ms':>7} {'1st ms':>7} {'TPOT p50':>9} "
          f"{'tok/s':>8} {'TTFT s':>7} {'1st s':>6} {'gap s':>6} "
          f"{'corr':>5} {'early':>5} {'changed':>7} {'recall GB/s':>11} {'pool tok':>9} {'GB/req':>7} {'max conc':>8} "
          f"{'ran/queued':>10}")
    for c in result["cells"]:
        if "step_ms" not in c:
            print(f"{c['config']:<16} error: {c.get('error', c.get('errors'))}")
            continue
        ratio = c["step_ms"] / full[c["batch"]]["step_ms"] if c["batch"] in full else float("nan")
        if c.get("decoding_together", c["batch"]) < c["batch"]:
            print(f"{c['config']:<16} {c['batch']:>5} only {c['decoding_together']} requests decoded together: "
                  "no step of this batch (raise --output-len past the other prompts' prefill)")
            continue
        print(f"{c['config']:<16} {c['batch']:>5} {c['step_ms']:>8.2f} {ratio:>7.2f} "
              f"{c.get('step_ms_p50', float('nan')):>7.2f} {c.get('first_step_ms', float('nan')):>7.1f} "
              f"{c['tpot_ms_p50']:>9.2f} "
              f"{c['output_tok_per_s']:>8.1f} "
              f"{c['ttft_s_p50']:>7.2f} {c.get('ttft_first_s', float('nan')):>6.2f} "
              f"{c.get('ttft_gap_s') or float('nan'):>6.3f} {c.get('correction_rate', float('nan')):>5.2f} "
              f"{c.get('early_correction_rate', float('nan')):>5.2f} "
              f"{c.get('changed_share') or float('nan'):>7.3f} "
              f"{c.get('recall_gbps') or float('nan'):>11.2f} {c.get('gpu_pool_tokens') or 0:>9} "
              f"{c.get('kv_gb_per_request', float('nan')):>7.3f} {c.get('max_concurrent') or 0:>8} "
              f"{str(c.get('max_running', '-')) + '/' + str(c.get('max_queued', '-')):>10}")
    for c in result["cells"]:
        if c.get("jit"):
            print(f"{c['config']} batch {c['batch']}: Triton compiled {len(c['jit'])} kernels while it ran: "
                  f"{', '.join(k.split('/')[-1] for k in c['jit'])}")
        if c.get("jit_modules"):
            print(f"{c['config']} batch {c['batch']}: {len(c['jit_modules'])} JIT modules were built while it ran: "
                  f"{', '.join(c['jit_modules'])}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama-3.1-8b", help="a shape of scripts/make_dummy_model.py")
    ap.add_argument("--context", type=int, default=32000)
    ap.add_argument("--batches", default="1,4,8", help="requests sent at once, comma-separated; 'max': as many as "
                    "the server's start-up lines say it holds before queueing (its memory_cell max_concurrent)")
    ap.add_argument("--max-running", type=int, default=0, help="--max-running-requests (default: the largest "
                    "batch, one more when prompts are longer than a prefill chunk; see max_running_requests)")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--configs", default="full,freekv,tau0,tau1,recall-all",
                    help="comma-separated; each a name above, optionally followed by more server flags")
    ap.add_argument("--freekv-args", default="--kv-budget 2048 --kv-sink 128 --kv-window 512 --kv-page-size 32 "
                    "--kvstore-arena-gb 36")
    ap.add_argument("--mem-fraction-static", default="0.75", help="'auto': SGLang's own choice for the GPU")
    ap.add_argument("--chunked-prefill", type=int, default=32768, help="--chunked-prefill-size of every server")
    ap.add_argument("--radix-cache", choices=("on", "off"), default="on",
                    help="on: every server keeps SGLang's default radix cache (FreeKV: its prompts are retained in the "
                    "kvstore); off: --disable-radix-cache, as the speed tables before session 14 ran")
    ap.add_argument("--prefill-cuda-graph", choices=("on", "off"), default="on",
                    help="off: --disable-prefill-cuda-graph on every server (SGLang 0.5.16 captures ~100 prefill "
                    "sizes at start-up, ~4.5 min on an H100 at 32K chunks; decode steps are the same either way)")
    ap.add_argument("--warmup-tokens", type=int, default=4096,
                    help="one untimed request of this many prompt tokens (16 new) after each server starts, so the "
                         "first timed batch does not pay Triton's compilation of the server's kernels (one chunk more "
                         "when the context is chunked: a chunk with a prefix builds FlashInfer's cascade module); 0: "
                         "none")
    ap.add_argument("--port", type=int, default=30010)
    ap.add_argument("--triton-cache", metavar="DIR",
                    help="one Triton cache for every server, kept across runs (a warm device machine's later FreeKV "
                         "servers then load FreeKV's kernels instead of compiling them again, ~1 min a start); the jit "
                         "column still lists what a timed batch compiled. Default: a new cache for each server")
    ap.add_argument("--profile-steps", type=int, default=0,
                    help="profile this many decode steps of each batch (see above); 0: no profile")
    ap.add_argument("--profile-cpu", action="store_true",
                    help="--profile-steps records CPU activity with Python stacks too (host waits, by caller)")
    ap.add_argument("--profile-first", type=int, default=0,
                    help="profile each batch's first N forwards from its sending (see above); 0: no profile")
    ap.add_argument("--out", default="results/decode")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    batches = [b if b == "max" else int(b) for b in args.batches.split(",")]
    configs = [spec.strip() for spec in args.configs.split(",")]
    for spec in configs:
        if not spec or spec.split()[0] not in CONFIGS:
            ap.error(f"--configs: unknown configuration {spec!r} (known: {', '.join(CONFIGS)})")
    numeric = [b for b in batches if b != "max"]
    if not (args.max_running or numeric):
        ap.error("--batches max alone needs --max-running")
    model = f"/tmp/dummy-{args.shape}"
    subprocess.run([sys.executable, str(ROOT / "scripts/make_dummy_model.py"), args.shape, model], check=True,
                   stdout=subprocess.DEVNULL)
    model_cfg = json.loads(Path(model, "config.json").read_text())
    vocab = model_cfg["vocab_size"]
    import torch

    gpu = torch.cuda.get_device_name()
    peak = copy_peak_gbps()
    print(f"{gpu}; host->GPU copy peak {peak:.1f} GB/s", flush=True)
    running = max_running_requests(args.max_running, numeric, args.context, args.chunked_prefill)
    common = ["--attention-backend", "flashinfer", "--sampling-backend", "pytorch", "--grammar-backend", "none",
              *(["--disable-radix-cache"] if args.radix_cache == "off" else []),
              *(["--disable-prefill-cuda-graph"] if args.prefill_cuda_graph == "off" else []),
              "--page-size", "32", "--context-length", str(args.context + args.output_len + 64),
              "--max-running-requests", str(running), "--chunked-prefill-size", str(args.chunked_prefill)]
    if args.mem_fraction_static != "auto":
        common += ["--mem-fraction-static", args.mem_fraction_static]
    env = dict(os.environ, FREEKV_STATS_EVERY=str(STATS_EVERY))
    result = {"gpu": gpu, "copy_peak_gbps": round(peak, 1), "shape": args.shape, "context": args.context,
              "radix_cache": args.radix_cache, "prefill_cuda_graph": args.prefill_cuda_graph,
              "output_len": args.output_len, "freekv_args": args.freekv_args, "cells": []}
    for name in configs:
        base, *more = name.split()
        extra = CONFIGS[base] + (args.freekv_args.split() if base != "full" else []) + more
        log_name = re.sub(r"[^\w.-]+", "_", name)
        subprocess.run(["pkill", "-9", "-f", "sglang.launch_server"], check=False)
        time.sleep(2)
        if args.triton_cache:
            cache = Path(args.triton_cache)
            cache.mkdir(parents=True, exist_ok=True)
        else:
            cache = Path(tempfile.mkdtemp(prefix=f"triton-{log_name}-"))
        srv = ServerProcess(name, args.port, ["--model-path", model, "--tokenizer-path", f"{model}/tokenizer",
                                              "--load-format", "dummy", *common, *extra],
                            out / f"server-{log_name}.log", dict(env, TRITON_CACHE_DIR=str(cache)))
        try:
            up = srv.wait(600)
            if args.warmup_tokens:  # long enough to select (past sink + window + budget) and offload
                warm = run_batch(srv.url, 1, warmup_length(args.context, args.warmup_tokens, args.chunked_prefill), 16,
                                 vocab, seed=0)
                if not warm.get("completed"):
                    raise RuntimeError(f"[{name}] the warm-up request failed: {warm.get('errors')}")
            log = srv.log.read_text(errors="replace")
            host = HOST.search(log)
            cap = {"startup_s": round(up, 1), "host_arena_gb": float(host.group(2)) if host else None,
                   **memory_cell(log, args.context + args.output_len)}
            for b in batches:
                b = cap.get("max_concurrent", 0) if b == "max" else b
                if not b:
                    raise RuntimeError(f"[{name}] --batches max: no concurrency figure in the start-up lines")
                offset = srv.log.stat().st_size
                trace_dir = out / f"trace-{log_name}-b{b}"
                if args.profile_steps:
                    profile_when_decoding(srv.url, srv.log, offset, b, args.profile_steps, trace_dir,
                                          cpu=args.profile_cpu)
                first_dir = out / f"trace-first-{log_name}-b{b}"
                if args.profile_first:
                    start_profile(srv.url, first_dir, args.profile_first, ["CPU", "GPU"], with_stack=True)
                compiled, built = triton_kernels(cache), jit_modules(jit_caches())
                cell = {"config": name, **run_batch(srv.url, b, args.context, args.output_len, vocab, seed=b), **cap}
                cell["jit"] = sorted(triton_kernels(cache) - compiled)
                cell["jit_modules"] = sorted(jit_modules(jit_caches()) - built)
                if args.profile_first:
                    cell["first_profile"] = summarize_trace(first_dir, 1, out / f"first-{log_name}-b{b}.txt",
                                                            top=40)
                if args.profile_steps:
                    cell["profile"] = summarize_trace(trace_dir, args.profile_steps,
                                                      out / f"profile-{log_name}-b{b}.txt")
                time.sleep(0.5)
                text = log_since(srv.log, offset)
                cell.update(scheduler_cell(text))
                window = engine_window(text, b)
                if window:
                    cell.update(window)
                    cell["recall_gbps"] = recall_gbps(cell, extra, model_cfg)
                    cell["changed_share"] = changed_share(cell, extra)
                result["cells"].append(cell)
                print(json.dumps(cell), flush=True)
                (out / "decode.json").write_text(json.dumps(result, indent=1))  # partial results survive a kill
        except Exception as e:
            result["cells"].append({"config": name, "error": str(e)[-2000:]})
            print(f"[{name}] failed: {e}", flush=True)
        finally:
            srv.stop()
    (out / "decode.json").write_text(json.dumps(result, indent=1))
    print_table(result)


if __name__ == "__main__":
    main()
