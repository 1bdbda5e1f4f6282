"""The host side of a copy-engine recall (docs/results/session55, section 7): each layer, gather the recalled chunks
of a kvstore-layout arena (one KV head's page: its FP8 K and V, 8 KB at page 32 and head dim 128, and their row
exponents) into one contiguous run that a single transfer moves. Times numpy's fancy indexing over the arena's bytes
straight into the pinned run (a memcpy a chunk, the GIL released), the chunks split over a pool of threads, by thread
count, against what the recall needs: the replay's chunks a layer (rows x KV heads x slots x churn x the host's share,
614 at 16 x 32K), every sparse layer within one decode step. (torch's advanced indexing copies byte by byte: ~1 GB/s
on two cores, against numpy's ~4.5.) Prints a table and writes JSON.

python benchmarks/host_gather.py --arena-gb 8 --threads 1,2,4,8,16
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from freekv_kvstore import ArenaGeometry


def byte_views(raw: torch.Tensor, g: ArenaGeometry, pages: int) -> tuple[np.ndarray, np.ndarray | None]:
    """uint8 views of a kvstore arena's bytes: the values [P, L, H, chunk] (K and V of one head's page) and, for a
    scaled dtype, their row exponents [P, L, H, 2 * page_size], which follow a page's values (freekv_kvstore.client.
    arena_views' layout, as bytes)."""
    L, H = g.num_layers, g.num_kv_heads
    chunk = g.value_bytes // (L * H)
    values = raw.as_strided((pages, L, H, chunk), (g.page_bytes, H * chunk, chunk, 1)).numpy()
    if not g.scaled:
        return values, None
    rows = 2 * g.page_size
    return values, raw.as_strided((pages, L, H, rows), (g.page_bytes, H * rows, rows, 1), g.value_bytes).numpy()


def gather(values: np.ndarray, exponents: np.ndarray | None, layer: int, page: np.ndarray, head: np.ndarray,
           out_values: np.ndarray, out_exponents: np.ndarray | None, pool: ThreadPoolExecutor | None = None,
           parts: int = 1) -> None:
    """Chunks (page[i], layer, head[i]) into out_values[i] (and their exponents into out_exponents[i]), in `parts`
    slices of the list on `pool`'s threads."""
    def part(s: slice) -> None:
        out_values[s] = values[page[s], layer, head[s]]
        if exponents is not None:
            out_exponents[s] = exponents[page[s], layer, head[s]]
    n = len(page)
    slices = [slice(n * i // parts, n * (i + 1) // parts) for i in range(parts)]
    if pool is None:
        for s in slices:
            part(s)
    else:
        for f in [pool.submit(part, s) for s in slices]:
            f.result()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arena-gb", type=float, default=4.0, help="arena size (filled first: untouched memory reads "
                                                                 "the zero page)")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--sparse-layers", type=int, default=31, help="layers a step recalls for")
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--page-size", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", default="float8_e4m3fn")
    ap.add_argument("--chunks", type=int, default=614, help="chunks a layer (16 rows x 8 heads x 64 slots x 0.15 "
                                                            "churn x 0.5 from the host)")
    ap.add_argument("--step-ms", type=float, default=10.9, help="the decode step the gather must fit in (16 x 32K)")
    ap.add_argument("--threads", default="1,2,4,8")
    ap.add_argument("--repeats", type=int, default=3, help="steps timed per thread count")
    ap.add_argument("--out", default="results/host_gather.json")
    args = ap.parse_args()

    g = ArenaGeometry(args.layers, args.kv_heads, args.page_size, args.head_dim, args.dtype)
    pages = max(1, int(args.arena_gb * 2**30) // g.page_bytes)
    pinned = torch.cuda.is_available()
    raw = torch.empty(pages * g.page_bytes, dtype=torch.uint8, pin_memory=pinned)
    raw.random_(0, 120)  # touched, and finite as FP8
    values, exponents = byte_views(raw, g, pages)
    n = args.chunks
    out_values = torch.empty(n, values.shape[-1], dtype=torch.uint8, pin_memory=pinned).numpy()
    out_exponents = None if exponents is None else \
        torch.empty(n, exponents.shape[-1], dtype=torch.uint8, pin_memory=pinned).numpy()
    chunk_bytes = values.shape[-1] + (0 if exponents is None else exponents.shape[-1])
    rng = np.random.default_rng(0)
    rows = []
    print(f"arena {pages} pages ({pages * g.page_bytes / 2**30:.1f} GiB, {'pinned' if pinned else 'pageable'}), "
          f"{n} chunks of {chunk_bytes} B a layer, {args.sparse_layers} layers a step, step {args.step_ms} ms")
    print(f"{'threads':>7} {'ms a layer':>10} {'GB/s':>6} {'ms a step':>9} {'share of step':>13}")
    for threads in (int(t) for t in args.threads.split(",")):
        times = []
        with ThreadPoolExecutor(threads) as pool:
            for _ in range(args.repeats * args.sparse_layers):
                page = rng.integers(0, pages, n)
                head = rng.integers(0, g.num_kv_heads, n)
                layer = int(rng.integers(0, g.num_layers))
                t0 = time.perf_counter()
                gather(values, exponents, layer, page, head, out_values, out_exponents, pool, threads)
                times.append(time.perf_counter() - t0)
        ms = statistics.median(times) * 1e3
        row = dict(threads=threads, ms_layer=ms, gbps=n * chunk_bytes / ms / 1e6, ms_step=ms * args.sparse_layers)
        row["share_of_step"] = row["ms_step"] / args.step_ms
        rows.append(row)
        print(f"{threads:>7} {ms:>10.3f} {row['gbps']:>6.1f} {row['ms_step']:>9.2f} {row['share_of_step']:>13.2f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "pages": pages, "pinned": pinned, "chunk_bytes": chunk_bytes,
                               "cpu_count": os.cpu_count(), "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
