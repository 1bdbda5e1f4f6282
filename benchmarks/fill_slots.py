"""What engine.fill_slots costs at the end of a prefill (GPU): a Llama-3.1-8B-shaped engine holds `batch` prompts of
`context` tokens (random K/V, every layer), staged in a paged buffer as SGLang's staging pages hold them; the fill is
timed as the host sees it (launches, until the call returns) and as the GPU runs it, against the decode step's
alternative, recalling each head's whole budget from the host (fill_slots without staging pages). Prints a table and
the profiler's slowest kernels; writes JSON.

    python3 benchmarks/fill_slots.py --out results/fill_slots.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from freekv_sglang.calibration import calibrate_synthetic, gaussian_sample
from freekv_sglang.config import FreeKVConfig
from freekv_sglang.engine import FreeKVEngine, ModelShape


def build(cfg: FreeKVConfig, shape: ModelShape, batch: int, context: int):
    p = cfg.page_size
    e = FreeKVEngine(cfg, shape, max_requests=batch, max_context=context + 64, dtype=torch.bfloat16, device="cuda",
                     dense_outside=True)
    calibrate_synthetic(e, gaussian_sample(e))
    W = -(-context // p)
    H, D = shape.num_kv_heads, shape.head_dim
    staging = [torch.randn(batch * W * p, H, D, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    pages = torch.arange(batch * W, device="cuda").view(batch, W)
    slots = []
    for b in range(batch):
        s = e.add_request()
        e.begin_prefill(s, context)
        rows = slice(b * W * p, b * W * p + context)
        for layer in range(shape.num_layers):
            if not e.dense[layer]:
                e.prefill_layer(s, layer, staging[0][rows], staging[1][rows],
                                torch.randn(shape.num_q_heads, D, dtype=torch.bfloat16, device="cuda"))
        slots.append(s)
    torch.cuda.synchronize()
    return e, slots, (lambda layer: staging), pages


def timed(fn, repeats: int) -> tuple[float, float]:
    """Median host ms until fn returns, and median ms until the GPU is done with it."""
    host, gpu = [], []
    for _ in range(repeats + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        host.append((t1 - t0) * 1e3)
        gpu.append((t2 - t0) * 1e3)
    return statistics.median(host[1:]), statistics.median(gpu[1:])


def measure(cfg: FreeKVConfig, shape: ModelShape, batch: int, context: int, repeats: int) -> dict:
    e, slots, kv, pages = build(cfg, shape, batch, context)

    def clear():
        e.slot_table[:, slots] = -1

    def staged():
        clear()
        e.fill_slots(slots, staged=(kv, pages))

    def host():
        clear()
        e.fill_slots(slots)

    row = {"batch": batch, "context": context}
    row["staged_host_ms"], row["staged_gpu_ms"] = timed(staged, repeats)
    row["recall_host_ms"], row["recall_gpu_ms"] = timed(host, repeats)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA,
                                            torch.profiler.ProfilerActivity.CPU]) as prof:
        staged()
        torch.cuda.synchronize()
    row["profile"] = prof.key_averages().table(sort_by="cuda_time_total", row_limit=12)
    print(row["profile"])
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=32000)
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="results/fill_slots.json")
    args = ap.parse_args()
    cfg = FreeKVConfig(budget=args.budget, sink=128, window=512, page_size=32)
    shape = ModelShape(32, 32, 8, 128)
    rows = [measure(cfg, shape, int(b), args.context, args.repeats) for b in args.batches.split(",")]
    print(f"{torch.cuda.get_device_name()}, Llama-3.1-8B shape, budget {args.budget}, context {args.context}")
    print(f"{'batch':>5} {'staged host ms':>15} {'staged GPU ms':>14} {'recall host ms':>15} {'recall GPU ms':>14}")
    for r in rows:
        print(f"{r['batch']:>5} {r['staged_host_ms']:>15.2f} {r['staged_gpu_ms']:>14.2f} {r['recall_host_ms']:>15.2f} "
              f"{r['recall_gpu_ms']:>14.2f}")
    with open(args.out, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "budget": args.budget, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
