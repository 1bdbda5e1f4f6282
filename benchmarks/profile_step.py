"""Where a FreeKV decode step's time goes, outside any server: the engine alone on one GPU.

    python3 benchmarks/profile_step.py --batches 1,4 --context 32000 --out results/profile-step.json

Llama-3.1-8B attention shape (32 layers, 32 query / 8 KV heads, head dim 128, bf16), the first layer dense
and left out (as in SGLang, where the wrapped backend runs it), FlashInfer attention as in the server. Per
batch and tau, a CUDA-graph-captured step (plan, 31 sparse layers, join) is timed by replay, beside:
  attention only   FlashInfer over the same sink + budget + window tokens per head (their token lists
                   built from the slot tables, one launch per layer), 31 layers: the floor a sparse
                   step cannot beat;
  full-KV          FlashInfer decode over the whole context, 31 layers: what full-KV SGLang pays here.
Then one eager step under torch.profiler: kernels launched per step and GPU time per kernel, grouped.
Queries are random (tau 0.9 flags nearly every head) or drift slowly from the previous step's (tau 0.9
then flags few heads), over random N(0, 1) keys; or structured: keys, values and queries from
benchmarks/realistic_churn.py's StructuredKV (attention concentrated on a few pages of a topic that persists, query
churn fitted to SmolLM2-135M); tau 0 never corrects; tau 1 with --kv-recall all recalls every selected page of every
head before attention, every step: the recall-bound case; tau 1 with drifting queries selects every head before
attention but recalls few pages, as random weights do in the server (benchmarks/decode.py). For each row, the bytes recalled in the profiled step
over the recall kernels' GPU time, beside the host-to-GPU copy peak measured at the start of the same run.
Each row's engine registers batch x context x 4 KiB per layer of host memory with CUDA: batch 16 at 32K and 32 layers
takes 69 GB, which failed to register on a 128 GB H100 host. A batch whose arena exceeds --host-gb runs with as many
layers as fit (printed, and `layers` in its rows; times scale with the sparse layers).
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from freekv_sglang.calibration import calibrate_synthetic, gaussian_sample
from freekv_sglang.config import FreeKVConfig
from freekv_sglang.engine import FreeKVEngine, ModelShape
from freekv_sglang.flashinfer_attention import FlashInferHeadAttention

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode import copy_peak_gbps
from realistic_churn import STRUCTURED, StructuredKV

LAYERS, HQ, H, D = 32, 32, 8, 128
BF = torch.bfloat16


def capture(fn, between=lambda: None) -> torch.cuda.CUDAGraph:
    """fn warmed up once on a side stream (as CUDA-graph capture requires), then `between`, then captured."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    between()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def graph_time(fn, reps: int = 50) -> float:
    """ms per call of fn captured in a CUDA graph (fn must be capturable)."""
    g = capture(fn)
    for _ in range(5):
        g.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        g.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e3


def layer_meta():
    return SimpleNamespace(scaling=D ** -0.5, logit_cap=0.0, k_scale_float=None, v_scale_float=None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--context", type=int, default=32000)
    ap.add_argument("--rows", default="0.9:random:delta,0.9:drifting:delta,0:random:delta,1:random:all,"
                    "1:drifting:delta", help="tau:queries:recall[:selection[/rerank_factor]] per row (queries: random, "
                    "drifting or structured; selection: the engine's default unless given, e.g. "
                    "0.9:random:delta:means or 0.9:structured:delta:rerank/0)")
    ap.add_argument("--layers", type=int, default=LAYERS, help="model layers; the first is dense and left out")
    # 65 GiB failed to register with CUDA on a 128 GB H100 host (batch 16 at 32K, 32 layers): stay well below it.
    ap.add_argument("--host-gb", type=float, default=40.0, help="host arena limit: fewer layers above it")
    ap.add_argument("--out", default="results/profile-step.json")
    args = ap.parse_args()
    import flashinfer

    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    inner = SimpleNamespace(workspace_buffer=ws, indices_updater_decode=SimpleNamespace(data_type=BF, q_data_type=BF),
                            decode_use_tensor_cores=True, disable_cuda_graph_kv_split=False, decode_split_tile_size=None)
    peak = copy_peak_gbps()
    print(f"{torch.cuda.get_device_name()}; host->GPU copy peak {peak:.1f} GB/s", flush=True)
    rows, keep = [], []
    for B in [int(b) for b in args.batches.split(",")]:
        host_pages = B * (args.context // 32 + 32)
        per_layer = host_pages * H * 2 * 32 * D * 2
        L = min(args.layers, int(args.host_gb * 1e9 // per_layer))
        if L < 2:
            print(f"batch {B}: skipped, host arena {2 * per_layer / 1e9:.0f} GB at 2 layers > --host-gb", flush=True)
            continue
        if L < args.layers:
            print(f"batch {B}: {L} layers instead of {args.layers} (host arena {args.layers * per_layer / 1e9:.0f} "
                  f"GB > --host-gb {args.host_gb:g})", flush=True)
        for spec in args.rows.split(","):
            tau_s, queries, recall, *sel = spec.split(":")
            selection, _, factor = (sel[0] if sel else FreeKVConfig().selection).partition("/")
            if queries not in ("random", "drifting", "structured"):
                raise SystemExit(f"--rows: queries must be random, drifting or structured, got {queries!r}")
            tau, drift = float(tau_s), queries == "drifting"
            gen = None if queries != "structured" else StructuredKV(L, B, HQ, H, D, args.context, "cuda", 0,
                                                                    **STRUCTURED)
            cfg = FreeKVConfig(budget=2048, sink=128, window=512, page_size=32, tau=tau, dense_layers=1,
                               recall=recall, selection=selection,
                               rerank_factor=int(factor) if factor else FreeKVConfig().rerank_factor)
            eng = FreeKVEngine(cfg, ModelShape(L, HQ, H, D), max_requests=B + 1, max_context=args.context + 512,
                               dtype=BF, device="cuda", backend="triton", pad_slot=0, dense_outside=True,
                               host_pages=host_pages)
            calibrate_synthetic(eng, gaussian_sample(eng) if gen is None else gen.calibration_sample(32))
            fi = FlashInferHeadAttention(inner, cfg, HQ, H, D, eng.num_slots, torch.device("cuda"))
            slots = list(range(1, B + 1))
            for row, s in enumerate(slots):
                eng.add_request(s)
                eng.begin_prefill(s, args.context)
                prompt = gen.prompt(row, args.context, 32) if gen is not None else None
                if prompt is not None:
                    next(prompt)  # layer 0 is dense and outside
                for layer in range(1, L):
                    k, v = ((x.to(BF) for x in next(prompt)) if prompt is not None else
                            (torch.randn(args.context, H, D, device="cuda", dtype=BF) for _ in range(2)))
                    eng.prefill_layer(s, layer, k, v)
            q = torch.randn(L, B, HQ, D, device="cuda", dtype=BF) if gen is None else gen.queries().to(BF)
            kv = torch.randn(2, L, B, H, D, device="cuda", dtype=BF)
            lens = [args.context]
            meta = layer_meta()

            def step():
                plan = eng.plan(B)
                for layer in range(1, L):
                    eng.attend(plan, layer, q[layer], kv[0, layer], kv[1, layer],
                               attention=lambda *a: fi.attend(meta, *a))
                eng.end_step()

            def advance():
                lens[0] += 1
                eng.prepare_step(slots, lens=[lens[0]] * B)
                fi.plan([lens[0]] * B, graph=True)
                if gen is not None:
                    gen.advance()
                    q.copy_(gen.queries())
                    kv.copy_(gen.step_kv())
                elif drift:
                    q.mul_(0.995).add_(torch.randn_like(q), alpha=0.1)
                else:
                    q.normal_()

            for _ in range(3):  # fill the slots, as the first decode steps of a request do
                advance()
                step()
            advance()
            g = capture(step, between=advance)
            times = []
            for _ in range(40):
                advance()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                g.replay()
                torch.cuda.synchronize()
                times.append((time.perf_counter() - t0) * 1e3)
            step_ms = sorted(times)[len(times) // 2]
            st = eng.stats()
            rate = sum(st["correction_rate"].values()) / len(st["correction_rate"])

            # Attention only, over the selection the last step left in the slot tables.
            plan = eng.plan(B)
            attn_ms = graph_time(lambda: [fi.attend(meta, q[i], eng.k_cache[i], eng.v_cache[i], plan, eng.slot_table[i])()
                                          for i in range(1, L)])

            # Torch profiler over one eager step: kernel count and GPU time by kernel.
            advance()
            before = eng.stats()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                step()
                torch.cuda.synchronize()
            by_name: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
            for e in prof.events():
                if e.device_type == torch.autograd.DeviceType.CUDA:
                    key = e.name[:60]
                    by_name[key][0] += 1
                    by_name[key][1] += e.device_time_total / 1e3
            after = eng.stats()
            recalled = sum(after[k] - before[k] for k in ("recall_bytes_now", "recall_bytes_speculative"))
            recall_ms = sum(v[1] for k, v in by_name.items() if k.startswith("_recall_pages_kernel"))
            kernels = sum(v[0] for v in by_name.values())
            gpu_ms = sum(v[1] for v in by_name.values())
            top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:12]
            row = {"batch": B, "layers": L, "tau": tau, "recall": recall, "queries": queries,
                   "selection": selection, "rerank_factor": cfg.rerank_factor,
                   "correction_rate": round(rate, 3), "step_ms_graph": round(step_ms, 3),
                   "recall_mb_per_step": round(recalled / 1e6, 2), "recall_kernel_ms": round(recall_ms, 3),
                   "recall_gbps": round(recalled / 1e6 / max(recall_ms, 1e-9), 1),
                   "recall_share_of_peak": round(recalled / 1e6 / max(recall_ms, 1e-9) / peak, 3),
                   "attention_only_ms": round(attn_ms, 3),
                   "eager_kernels_per_step": kernels, "eager_gpu_ms_per_step": round(gpu_ms, 3),
                   "top_kernels": [(k, n, round(ms, 3)) for k, (n, ms) in top]}
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "top_kernels"}), flush=True)
            keep.append(fi)  # see tests/engine/test_flashinfer_attention.py: freed graph wrappers upset FlashInfer
            # Free this engine's pinned host pages before the next row allocates its own (B x context each).
            del g, step, advance, eng
            gc.collect()
            torch.cuda.empty_cache()

        # Full-KV FlashInfer decode over the whole context, 31 layers (tensor cores, as SGLang uses for G=4).
        kc = torch.randn(B * (args.context + 1), H, D, device="cuda", dtype=BF)
        n = args.context + 1
        idx = torch.arange(B * n, dtype=torch.int32, device="cuda")
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            ws, "NHD", use_tensor_cores=True, use_cuda_graph=True, paged_kv_indices_buffer=idx,
            paged_kv_indptr_buffer=torch.zeros(B + 1, dtype=torch.int32, device="cuda"),
            paged_kv_last_page_len_buffer=torch.ones(B, dtype=torch.int32, device="cuda"))
        w.plan(torch.arange(B + 1, dtype=torch.int32) * n, idx[:0], torch.ones(B, dtype=torch.int32), HQ, H, D, 1,
               data_type=BF, q_data_type=BF)
        keep.append(w)  # FlashInfer graph-mode wrappers must outlive the process's later plans
        qf = torch.randn(B, HQ, D, device="cuda", dtype=BF)
        full_ms = graph_time(lambda: [w.run(qf, (kc[:, None], kc[:, None])) for _ in range(L - 1)])
        rows.append({"batch": B, "layers": L, "full_kv_attention_ms": round(full_ms, 3)})
        print(json.dumps(rows[-1]), flush=True)
        torch.cuda.empty_cache()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "copy_peak_gbps": round(peak, 1),
                                          "context": args.context, "rows": rows}, indent=1))
    for r in rows:
        if "top_kernels" in r:
            print(f"\nbatch {r['batch']} ({r['layers']} layers) tau {r['tau']} recall {r['recall']} {r['queries']} "
                  f"{r['selection']}/{r['rerank_factor']}: "
                  f"{r['eager_kernels_per_step']} kernels, {r['eager_gpu_ms_per_step']} ms GPU per eager step; step "
                  f"{r['step_ms_graph']} ms in a graph; recall {r['recall_mb_per_step']} MB in {r['recall_kernel_ms']} "
                  f"ms = {r['recall_gbps']} GB/s ({100 * r['recall_share_of_peak']:.0f}% of the {peak:.1f} GB/s peak)")
            for name, cnt, ms in r["top_kernels"]:
                print(f"  {ms:8.3f} ms {cnt:5d}x {name}")


if __name__ == "__main__":
    main()
