"""Benchmarks of the kvstore daemon and its client (CPU only).

Measures, against daemons started for the run (embedded mode, one over ipc:// and one over tcp://127.0.0.1):
  connect  HELLO + pre-faulting + mapping a fresh arena (GB/s of arena made ready);
  control  round-trip latency of PING and of a 1-page ALLOC + FREE pair (p50/p99 in microseconds);
  alloc    allocations per second: one page per call, and batched (many requests in one ALLOC);
  pages    page bytes written into / read out of the shared arena by the CPU (torch copies), contiguous
           and to random pages.

    python benchmarks/kvstore.py [--out results/kvstore.json] [--arena-gib 1] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import msgpack
import psutil
import torch
import zmq

from freekv_kvstore import ArenaGeometry, KVStoreClient, start_embedded

GiB = 1 << 30
# Llama-3.1-8B: 32 layers, 8 KV heads, head dim 128, bf16, FreeKV page size 32: one host page is 4 MiB.
GEOM = ArenaGeometry(num_layers=32, num_kv_heads=8, page_size=32, head_dim=128, dtype="bfloat16")
# For control-path numbers the page size is irrelevant; small pages keep the arena small.
SMALL = ArenaGeometry(num_layers=1, num_kv_heads=1, page_size=32, head_dim=64, dtype="bfloat16")


def percentiles_us(samples: list[float]) -> dict:
    qs = statistics.quantiles(samples, n=100, method="inclusive")
    mean = statistics.fmean(samples)
    return {"p50_us": qs[49] * 1e6, "p99_us": qs[98] * 1e6, "mean_us": mean * 1e6, "n": len(samples)}


def timed(fn: Callable[[], object], n: int, warmup: int = 50) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def bench_control(client: KVStoreClient, n: int) -> dict:
    ping = timed(client.ping, n)

    def alloc_free() -> None:
        client.alloc(1, 1)
        client.free(1)

    pair = timed(alloc_free, n // 2)
    return {"ping": percentiles_us(ping), "alloc_free_pair": percentiles_us(pair)}


def bench_alloc(client: KVStoreClient, seconds: float, batch: int) -> dict:
    def rate(step: Callable[[int], int]) -> float:
        done, i, t0 = 0, 0, time.perf_counter()
        while (elapsed := time.perf_counter() - t0) < seconds:
            done += step(i)
            i += 1
        return done / elapsed

    def single(i: int) -> int:
        client.alloc(i, 1)
        client.free(i)
        return 1

    def batched(i: int) -> int:
        ids = range(i * batch, (i + 1) * batch)
        client.alloc_many([(r, 4) for r in ids])
        client.free_many(ids)
        return batch

    batched_rate = rate(batched)
    return {
        "single_page_allocs_per_s": rate(single),
        "batched_requests_per_s": batched_rate,
        "batched_pages_per_s": 4 * batched_rate,
        "batch": batch,
        "note": "every allocation is paired with its FREE in the timing",
    }


def bench_pages(client: KVStoreClient, pages_per_op: int, repeats: int) -> dict:
    arena = client.arena
    num_pages = arena.shape[0]
    n = min(pages_per_op, num_pages)
    src = torch.randn((n, *arena.shape[1:]), dtype=torch.float32).to(arena.dtype)
    dst = torch.empty_like(src)
    nbytes = n * client.page_bytes
    gen = torch.Generator().manual_seed(0)
    picks = [torch.randperm(num_pages, generator=gen)[:n] for _ in range(repeats + 1)]

    def gbps(fn: Callable[[int], object]) -> float:
        fn(0)  # warm-up
        times = []
        for i in range(repeats):
            t0 = time.perf_counter()
            fn(i + 1)
            times.append(time.perf_counter() - t0)
        return nbytes / statistics.median(times) / 1e9

    # Pages as rows of bytes: torch's row gather/scatter is much faster on 2-D views than on 6-D ones.
    rows, src_rows, dst_rows = arena.view(num_pages, -1), src.view(n, -1), dst.view(n, -1)
    out: dict = {"pages_per_op": n, "bytes_per_op": nbytes}
    default_threads = torch.get_num_threads()
    for threads in sorted({1, default_threads}):
        torch.set_num_threads(threads)
        out[f"threads_{threads}"] = {
            "write_contiguous_gbps": gbps(lambda i: arena[:n].copy_(src)),
            "read_contiguous_gbps": gbps(lambda i: dst.copy_(arena[:n])),
            "write_random_gbps": gbps(lambda i: rows.index_copy_(0, picks[i], src_rows)),
            "read_random_gbps": gbps(lambda i: torch.index_select(rows, 0, picks[i], out=dst_rows)),
        }
    torch.set_num_threads(default_threads)
    if not torch.equal(dst.view(torch.int16), arena[picks[repeats]].view(torch.int16)):
        raise RuntimeError("pages read back differ from the arena: the benchmark measured a broken copy")
    return out


def connect(kv, geometry: ArenaGeometry, num_pages: int, client_id: str) -> tuple[KVStoreClient, float]:
    t0 = time.perf_counter()
    client = KVStoreClient.connect(
        kv.endpoint, geometry=geometry, num_pages=num_pages, client_id=client_id, token=kv.token, cuda_register=False
    )
    return client, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="results/kvstore.json", help="JSON results path")
    ap.add_argument("--arena-gib", type=float, default=1.0, help="arena of the page-copy benchmark (4 MiB pages)")
    ap.add_argument("--round-trips", type=int, default=5000, help="timed control round trips per transport")
    ap.add_argument("--alloc-seconds", type=float, default=2.0, help="duration of each allocation-rate run")
    ap.add_argument("--batch", type=int, default=64, help="requests per batched ALLOC")
    ap.add_argument("--pages-per-op", type=int, default=64, help="pages moved by one timed copy")
    ap.add_argument("--repeats", type=int, default=10, help="timed copies per page measurement (median)")
    ap.add_argument("--quick", action="store_true", help="fewer samples, for a smoke run")
    args = ap.parse_args()
    if args.quick:
        args.round_trips, args.alloc_seconds, args.repeats = 500, 0.3, 3

    env = {
        "cpu": platform.processor() or platform.machine(),
        "cpu_model": _cpu_model(),
        "logical_cpus": os.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / GiB, 1),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "pyzmq": zmq.__version__,
        "libzmq": zmq.zmq_version(),
        "msgpack": ".".join(map(str, msgpack.version)),
        "geometry": {"page": repr(GEOM), "page_bytes": GEOM.page_bytes},
    }
    print(f"{env['cpu_model']}  {env['logical_cpus']} CPUs  {env['memory_gib']} GiB  torch {env['torch']}  "
          f"libzmq {env['libzmq']}")  # fmt: skip
    results: dict = {"env": env, "args": vars(args)}
    num_pages = max(args.pages_per_op, int(args.arena_gib * GiB) // GEOM.page_bytes)
    budget_gib = num_pages * GEOM.page_bytes / GiB + 0.5

    with start_embedded(arena_gb=budget_gib) as ipc, start_embedded(0.5, endpoint="tcp://127.0.0.1:0") as tcp:
        for name, kv in (("ipc", ipc), ("tcp", tcp)):
            client, _ = connect(kv, SMALL, 1024, f"control-{name}")
            with client:
                results[f"control_{name}"] = bench_control(client, args.round_trips)
                if name == "ipc":
                    results["alloc"] = bench_alloc(client, args.alloc_seconds, args.batch)
        client, seconds = connect(ipc, GEOM, num_pages, "pages")
        with client:
            arena_bytes = num_pages * GEOM.page_bytes
            results["connect"] = {"arena_bytes": arena_bytes, "seconds": seconds, "gbps": arena_bytes / seconds / 1e9}
            results["pages"] = bench_pages(client, args.pages_per_op, args.repeats)

    _print_table(results)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + os.linesep)
    print(f"\nwrote {out}")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown"


def _print_table(r: dict) -> None:
    rows = []
    for t in ("ipc", "tcp"):
        for what, label in (("ping", "PING"), ("alloc_free_pair", "ALLOC 1 + FREE")):
            m = r[f"control_{t}"][what]
            rows.append((f"control {label} round trip ({t})", f"p50 {m['p50_us']:.0f} us   p99 {m['p99_us']:.0f} us"))
    a = r["alloc"]
    rows.append(("allocations, 1 page per call (+ free)", f"{a['single_page_allocs_per_s']:,.0f} /s"))
    batched = f"{a['batched_requests_per_s']:,.0f} requests/s, {a['batched_pages_per_s']:,.0f} pages/s"
    rows.append((f"allocations, batched x{a['batch']} requests (+ free)", batched))
    c = r["connect"]
    rows.append((f"connect: new {c['arena_bytes'] / GiB:.2f} GiB arena ready + mapped",
                 f"{c['seconds']:.2f} s ({c['gbps']:.2f} GB/s)"))  # fmt: skip
    p = r["pages"]
    size = f"{p['pages_per_op']} x {p['bytes_per_op'] // p['pages_per_op'] >> 20} MiB pages"
    runs = [k for k in p if k.startswith("threads_")]
    rows.append((f"CPU page copies ({size}), GB/s", "   ".join(f"{k.split('_')[1]:>2} thread(s)" for k in runs)))
    for key, label in (("write_contiguous_gbps", "write, contiguous pages"), ("read_contiguous_gbps",
                       "read, contiguous pages"), ("write_random_gbps", "write, random pages"),
                       ("read_random_gbps", "read, random pages")):  # fmt: skip
        rows.append((f"  {label}", "   ".join(f"{p[k][key]:>12.2f}" for k in runs)))
    width = max(len(k) for k, _ in rows)
    print()
    for k, v in rows:
        print(f"{k:<{width}}  {v}")


if __name__ == "__main__":
    main()
