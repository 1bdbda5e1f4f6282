"""GPU benchmarks for the FreeKV kernels (needs a CUDA device).

Measures, in one run:
  link   the host<->GPU link peak: one large pinned copy_ each way; the device-memory copy bandwidth;
  recall recall_pages gathering random 16 KiB (page, head) chunks straight from a pinned host arena (GB/s, % of peak),
         every (row, head, slot) of a batch recalled, the slot and page tables read by the kernel;
  recall before attention (--recall-blocks; alone with --only-recall-blocks) the recall of a correction: a share of
         (row, KV head) pairs flagged, a share of their slots changed, either pair by pair or whole rows (a surprising
         token moves every head of its row); one program per (row, head, slot) item, as the engine launches it, against
         capped programs over blocks of slots (recall_pages' programs and slot_block);
  speculative recall beside (--only-recall-beside) the speculative recall's shape (every (row, KV head) pair, a
         share of its slots changed) with capped programs or one per item, alone, beside decode-sized GEMMs on another
         stream (the step's weights streaming from HBM, where the served step runs it) and beside an HBM copy; and
         the copy engine moving as many bytes in one contiguous copy, the same three ways;
  offload offload_pages writing whole GPU pages into the pinned arena, summaries included (GB/s, % of the GPU->host
         peak);
  select page scoring (means, quest, the sketch alone, rerank of the sketch's candidates, rerank-all over every page,
         the channel sketch)
         + select_slots latency
         per layer (eager and CUDA-graph replay, scoring and selection each alone in a graph, and the floor: reading
         the summaries and codes once at the measured device-copy bandwidth).
Recall/offload are timed twice: "eager" events around one call on an idle GPU, which include the host's launch of
the Triton kernel (~20+ us of Python), and "gpu" with that launch hidden behind a short spin kernel, i.e. the GPU
time a CUDA-graph replay (the engine's decode step) sees.
A correctness check of recall/offload against the torch references runs on the GPU before any timing.
--host-dtype fp8_e4m3 runs the recall and offload benchmarks on an FP8 arena (e4m3 rows with their exponents, as
--kv-host-dtype serves it): 8.06 KiB chunks instead of 16, every rate counted in the bytes that cross the link.

    python benchmarks/kernels.py [--out results/kernels.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import torch
import triton

from freekv_kernels.offload import naive_offload_pages, offload_pages
from freekv_kernels.recall import naive_recall_pages, recall_pages

from freekv_sglang.config import DEFAULT_SKETCH_CHANNELS, HOST_DTYPES
from gpu_timing import graph_replay_ms, time_ms
from host_arena import HostLayer, pinned_empty

DEVICE = torch.device("cuda")
GiB = 1 << 30

# Llama-3.1-8B: 32 query heads over 8 KV heads, head dim 128, bf16; FreeKV page size 32.
HQ, H, D, PAGE, DTYPE = 32, 8, 128, 32, torch.bfloat16
CHUNK_BYTES = 2 * PAGE * D * DTYPE.itemsize  # one (page, head): K then V, 16 KiB
SLOTS = 64  # selection slots per (row, head): a 2048-token budget


def gbps(nbytes: int, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e9


def recall_set(n: int, src_pages: int, phase: int = 1) -> tuple[torch.Tensor, ...]:
    """recall_pages inputs for n (row, head, slot) chunks: rows of H heads and SLOTS slots, the first n entries
    coded `phase` (the rest 0), random host pages behind random logical pages, row b's slots on GPU pages
    b*SLOTS .. b*SLOTS+SLOTS-1. A fresh draw per timed call keeps earlier calls' chunks out of the GPU's L2."""
    B, M = -(-n // (H * SLOTS)), 4 * SLOTS
    page_table = torch.randint(0, src_pages, (B, M), dtype=torch.int32, device=DEVICE)
    slots = torch.randint(0, M, (B, H, SLOTS), dtype=torch.int32, device=DEVICE)
    req_slots = torch.arange(B, dtype=torch.int32, device=DEVICE)
    slot_pages = torch.arange(B * SLOTS, dtype=torch.int32, device=DEVICE).view(B, SLOTS)
    recall = torch.zeros(B * H * SLOTS, dtype=torch.int8, device=DEVICE)
    recall[:n] = phase
    return page_table, slots, req_slots, slot_pages, recall.view(B, H, SLOTS)


def check_correctness() -> dict:
    """recall_pages / offload_pages against the torch references on this GPU, with pinned memory and entries of
    another phase carrying garbage indices. Raises on a mismatch: there is no point timing a wrong kernel."""
    P, n = 61, 3 * H * SLOTS - 77
    host_layer = torch.randn(P, 3, H, 2, PAGE, D, dtype=DTYPE).pin_memory()[:, 1]  # a strided layer view
    page_table, slots, req_slots, slot_pages, recall = recall_set(n, P, phase=2)
    recall.view(-1)[torch.rand(recall.numel(), device=DEVICE) < 0.3] = 1  # the other phase's entries ...
    slots[recall.view(slots.shape) != 2] = 1 << 28  # ... and unused ones name no valid page
    gpu_pages = slot_pages.numel()
    caches = {}
    for name, fn in (("naive", naive_recall_pages), ("triton", recall_pages)):
        k, v = torch.full((2, gpu_pages * PAGE, H, D), float("nan"), dtype=DTYPE, device=DEVICE)
        fn(host_layer, k, v, page_table, slots, req_slots, slot_pages, recall, 2, PAGE)
        caches[name] = torch.stack([k, v])
    recall_ok = torch.equal(caches["naive"].isnan(), caches["triton"].isnan()) and torch.equal(
        caches["naive"].nan_to_num(), caches["triton"].nan_to_num()
    )

    k, v = torch.randn(2, gpu_pages * PAGE + 7, H, D, dtype=DTYPE, device=DEVICE)  # partial last page
    osrc = torch.randperm(gpu_pages + 1, device=DEVICE)[:17].int()
    odst = torch.randperm(P, device=DEVICE)[:17].int()
    ovalid = torch.rand(17, device=DEVICE) < 0.8
    osrc, odst = (torch.where(ovalid, t, -1) for t in (osrc, odst))
    arenas, summaries = {}, {}
    for name, fn in (("naive", naive_offload_pages), ("triton", offload_pages)):
        arena = torch.full((P, H, 2, PAGE, D), float("nan"), dtype=DTYPE).pin_memory()
        summ = torch.full((P, H, 2, D), float("nan"), dtype=DTYPE, device=DEVICE)
        fn(k, v, arena, summ, osrc, odst, ovalid, PAGE)
        torch.cuda.synchronize()
        arenas[name], summaries[name] = arena, summ
    offload_ok = all(
        torch.equal(out["naive"].isnan(), out["triton"].isnan())
        and torch.equal(out["naive"].nan_to_num(), out["triton"].nan_to_num())
        for out in (arenas, summaries)
    )
    result = {"recall_ok": recall_ok, "offload_ok": offload_ok}
    print(f"correctness vs torch reference: {result}")
    if not (recall_ok and offload_ok):
        raise SystemExit("kernel output differs from the torch reference; not timing it")
    return result


def bench_link(gib: float, repeats: int) -> dict:
    """One large pinned copy_ each way: the ceiling for any zero-copy kernel on this link."""
    nbytes = int(gib * GiB)
    host = pinned_empty(nbytes, dtype=torch.uint8)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=DEVICE)
    h2d = time_ms(lambda i: dev.copy_(host, non_blocking=True), repeats, warmup=2)
    d2h = time_ms(lambda i: host.copy_(dev, non_blocking=True), repeats, warmup=2)
    res = {"bytes": nbytes, "h2d_ms": h2d, "h2d_gbps": gbps(nbytes, h2d), "d2h_ms": d2h, "d2h_gbps": gbps(nbytes, d2h)}
    del host
    src = dev[: nbytes // 2]
    dst = torch.empty_like(src)
    d2d = time_ms(lambda i: dst.copy_(src), repeats, warmup=2)
    res["d2d_gbps"] = gbps(2 * src.numel(), d2d)  # bytes read + written
    print(f"\nlink peak ({nbytes / GiB:.2f} GiB pinned copy_): host->GPU {res['h2d_gbps']:.1f} GB/s, "
          f"GPU->host {res['d2h_gbps']:.1f} GB/s; device copy {res['d2d_gbps'] / 1e3:.2f} TB/s (read + write)")
    return res


def bench_recall(host: HostLayer, sizes: list[int], peak: float, repeats: int, warmup: int) -> list[dict]:
    gpu_pages = -(-max(sizes) // (H * SLOTS)) * SLOTS  # every (page, head) of the GPU cache can be a destination
    k, v = torch.empty(2, gpu_pages * PAGE, H, D, dtype=DTYPE, device=DEVICE)
    print(f"\nrecall_pages: random {host.chunk_bytes / 1024:.2f} KiB (page, head) chunks from a "
          f"{host.pages * H * host.chunk_bytes / GiB:.1f} GiB pinned arena into a {gpu_pages}-page GPU cache")
    print(f"{'chunks':>8} {'MiB':>8} {'ms':>9} {'GB/s':>8} {'% peak':>7} {'gpu ms':>9} {'gpu GB/s':>9} {'gpu %':>7}")
    rows = []
    for n in sizes:
        calls = warmup + repeats
        sets = [recall_set(n, host.pages) for _ in range(2 * calls)]  # fresh draws for each pass
        row = {"chunks": n, "bytes": n * host.chunk_bytes}
        for off, pre, hide in ((0, "", False), (calls, "gpu_", True)):
            ms = time_ms(lambda i, off=off, sets=sets: recall_pages(host.layer, k, v, *sets[off + i], 1, PAGE,
                                                                    **host.kw), repeats, warmup, hide)
            row[pre + "ms"], row[pre + "gbps"] = ms, gbps(n * host.chunk_bytes, ms)
            row[pre + "pct_peak"] = 100 * row[pre + "gbps"] / peak
        rows.append(row)
        print(f"{n:>8} {row['bytes'] / 2**20:>8.0f} {row['ms']:>9.3f} {row['gbps']:>8.1f} {row['pct_peak']:>6.1f}% "
              f"{row['gpu_ms']:>9.3f} {row['gpu_gbps']:>9.1f} {row['gpu_pct_peak']:>6.1f}%")
    return rows


def correction_set(batch: int, flagged: float, changed: float, by_row: bool, src_pages: int,
                   gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """recall_pages inputs of a recall before attention: (row, head) pairs flagged with probability `flagged` (whole
    rows with it when by_row), each slot of a flagged pair changed (coded PHASE_NOW) with probability `changed`."""
    M = 4 * SLOTS
    page_table = torch.randint(0, src_pages, (batch, M), dtype=torch.int32, device=DEVICE, generator=gen)
    slots = torch.randint(0, M, (batch, H, SLOTS), dtype=torch.int32, device=DEVICE, generator=gen)
    req_slots = torch.arange(batch, dtype=torch.int32, device=DEVICE)
    slot_pages = torch.arange(batch * SLOTS, dtype=torch.int32, device=DEVICE).view(batch, SLOTS)
    pairs = (batch, 1) if by_row else (batch, H)
    flags = torch.rand(pairs, device=DEVICE, generator=gen) < flagged
    hit = flags[:, :, None] & (torch.rand(batch, H, SLOTS, device=DEVICE, generator=gen) < changed)
    return page_table, slots, req_slots, slot_pages, hit.to(torch.int8)


def bench_recall_blocks(host: HostLayer, batch: int, flagged: float, changed: float, programs: list[int],
                        blocks: list[int], peak: float, repeats: int, warmup: int) -> list[dict]:
    k, v = torch.empty(2, batch * SLOTS * PAGE, H, D, dtype=DTYPE, device=DEVICE)
    print(f"\nrecall before attention: {batch} rows x {H} KV heads x {SLOTS} slots, {flagged:.2f} of the pairs "
          f"flagged, {changed:.2f} of a flagged pair's slots changed; GPU time (launch hidden), a fresh draw per call")
    print(f"{'flags by':>8} {'programs':>8} {'block':>5} {'us':>8} {'GB/s':>7} {'% peak':>7} {'x per item':>10}")
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    rows = []
    for by_row in (False, True):
        sets = [correction_set(batch, flagged, changed, by_row, host.pages, gen) for _ in range(warmup + repeats)]
        nbytes = statistics.mean(int(s[4].sum()) for s in sets) * host.chunk_bytes
        base = None
        for progs, block in [(0, 0)] + [(p, b) for p in programs for b in blocks]:
            ms = time_ms(lambda i, p=progs, b=block: recall_pages(host.layer, k, v, *sets[i], 1, PAGE, programs=p,
                                                                  slot_block=b, **host.kw), repeats, warmup, True)
            base = base or ms
            row = {"flags_by": "row" if by_row else "pair", "programs": progs, "slot_block": block, "ms": ms,
                   "bytes": nbytes, "gbps": gbps(nbytes, ms), "speedup": base / ms}
            row["pct_peak"] = 100 * row["gbps"] / peak
            rows.append(row)
            print(f"{row['flags_by']:>8} {progs or 'items':>8} {block or '-':>5} {ms * 1e3:>8.1f} {row['gbps']:>7.1f} "
                  f"{row['pct_peak']:>6.1f}% {row['speedup']:>10.2f}")
    return rows


def bench_recall_beside(host: HostLayer, batch: int, changed: float, programs: list[int], peak: float,
                        repeats: int, warmup: int) -> list[dict]:
    k, v = torch.empty(2, batch * SLOTS * PAGE, H, D, dtype=DTYPE, device=DEVICE)
    # Beside: a decode step's GEMM (batch rows times an MLP weight, ~117 MB of bf16 from HBM a call, ~30 us on an
    # H200: cuBLAS tiles that take most of an SM's shared memory), or an HBM copy of as many bytes (elementwise
    # programs, little shared memory), each enqueued on another stream ahead of the timed call and outlasting it.
    x = torch.randn(batch, 4096, dtype=DTYPE, device=DEVICE)
    w = torch.randn(4096, 14336, dtype=DTYPE, device=DEVICE)
    a, b = torch.empty(2, w.numel(), dtype=DTYPE, device=DEVICE)
    side = torch.cuda.Stream()
    work = {"idle": None, "gemms": lambda: torch.matmul(x, w), "hbm copy": lambda: a.copy_(b)}

    def background(fn):
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(48):
                fn()

    gen = torch.Generator(device=DEVICE).manual_seed(0)
    sets = [correction_set(batch, 1.0, changed, False, host.pages, gen) for _ in range(warmup + repeats)]
    nbytes = statistics.mean(int(s[4].sum()) for s in sets) * host.chunk_bytes
    src = pinned_empty(int(nbytes), dtype=torch.uint8)
    dst = torch.empty(int(nbytes), dtype=torch.uint8, device=DEVICE)
    print(f"\nspeculative recall: {batch} rows x {H} KV heads x {SLOTS} slots, {changed:.2f} of every pair's slots "
          f"changed ({nbytes / 1e6:.1f} MB), alone and beside other work; GPU time (launch hidden), a fresh draw per "
          f"call; 'copy engine' is one contiguous pinned copy_ of as many bytes")
    print(f"{'beside':>9} {'programs':>12} {'us':>8} {'GB/s':>7} {'% peak':>7}")
    rows = []
    for beside, fn in work.items():
        for progs in [*programs, "copy engine"]:
            def run(i, progs=progs, fn=fn):
                if fn is not None:
                    background(fn)
                if progs == "copy engine":
                    dst.copy_(src, non_blocking=True)
                else:
                    recall_pages(host.layer, k, v, *sets[i], 1, PAGE, programs=progs, **host.kw)
            ms = time_ms(run, repeats, warmup, True)
            torch.cuda.synchronize()
            row = {"beside": beside, "programs": progs, "ms": ms, "bytes": nbytes, "gbps": gbps(nbytes, ms)}
            row["pct_peak"] = 100 * row["gbps"] / peak
            rows.append(row)
            print(f"{beside:>9} {progs or 'items':>12} {ms * 1e3:>8.1f} {row['gbps']:>7.1f} {row['pct_peak']:>6.1f}%")
    return rows


def bench_offload(host: HostLayer, sizes: list[int], peak: float, repeats: int, warmup: int) -> list[dict]:
    gpu_pages, P = max(sizes), host.pages
    k, v = torch.randn(2, gpu_pages * PAGE, H, D, dtype=DTYPE, device=DEVICE)
    page_bytes = H * host.chunk_bytes
    summaries = torch.empty(P, H, 2, D, dtype=DTYPE, device=DEVICE)
    print(f"\noffload_pages: whole GPU pages (all {H} heads, {page_bytes // 1024} KiB) into random host pages, "
          f"summaries included")
    print(f"{'pages':>8} {'MiB':>8} {'ms':>9} {'GB/s':>8} {'% peak':>7} {'gpu ms':>9} {'gpu GB/s':>9} {'gpu %':>7}")
    rows = []
    for n in sizes:
        calls = warmup + repeats
        sets = [
            (torch.randperm(gpu_pages, device=DEVICE)[:n].int(), torch.randperm(P, device=DEVICE)[:n].int())
            for _ in range(2 * calls)  # fresh draws for each pass
        ]
        valid = torch.ones(n, dtype=torch.bool, device=DEVICE)
        row = {"pages": n, "bytes": n * page_bytes}
        for off, pre, hide in ((0, "", False), (calls, "gpu_", True)):
            ms = time_ms(lambda i, off=off, sets=sets, valid=valid: offload_pages(k, v, host.layer, summaries,
                                                                                   *sets[off + i], valid, PAGE,
                                                                                   **host.kw), repeats, warmup, hide)
            row[pre + "ms"], row[pre + "gbps"] = ms, gbps(n * page_bytes, ms)
            row[pre + "pct_peak"] = 100 * row[pre + "gbps"] / peak
        rows.append(row)
        print(f"{n:>8} {row['bytes'] / 2**20:>8.0f} {row['ms']:>9.3f} {row['gbps']:>8.1f} {row['pct_peak']:>6.1f}% "
              f"{row['gpu_ms']:>9.3f} {row['gpu_gbps']:>9.1f} {row['gpu_pct_peak']:>6.1f}%")
    return rows


def bench_select(
    contexts: list[int], batches: list[int], budget: int, repeats: int, warmup: int, copy_gbps: float,
    rerank_factors: tuple[int, ...] = (2, 4, 0), sketch_channels: int = 16, channel_widths: tuple[int, ...] = (32,),
) -> dict | list[dict]:
    try:
        from freekv_kernels.channel_sketch import channel_sketch_pages
        from freekv_kernels.churn_replay import replay_churn
        from freekv_kernels.page_rerank import empty_codes, rerank_pages, sketch_pages, top_pages
        from freekv_kernels.page_select import PHASE_NOW, score_pages, select_slots
    except ImportError as e:
        print(f"\nselection: skipped, freekv_kernels.page_select is not importable ({e})")
        return {"skipped": str(e)}
    k = budget // PAGE
    nbytes = sketch_channels // 4
    print(f"\nselection per layer: scoring + select_slots (top-k, slot delta, commit), {HQ} q heads / {H} KV "
          f"heads, D={D}, p={PAGE}, k={k} pages ({budget} tokens), every page of every row a candidate. means: "
          f"score_pages (MeanS); quest: score_pages (max); sketch: the sketch alone (the default); rerank/N: the sketch ({sketch_channels} channels' codes "
          f"and every page's mid-range) over every page, its top N*k candidates rescored from all their 2-bit key "
          f"codes; rerank/0: every page's codes rescored, no sketch; channelsR: the channel sketch, 4-bit codes of R calibrated "
          f"channels per token, no summaries (kernels/channel_sketch). graph: the whole selection captured and "
          f"replayed (score / select: each part alone); floor: the bf16 summaries and the codes read once at "
          f"{copy_gbps / 1e3:.2f} TB/s")
    print(f"{'context':>8} {'batch':>6} {'selection':>14} {'eager us':>9} {'graph us':>9} {'score us':>9} "
          f"{'select us':>9} {'floor us':>9} {'x floor':>8}")
    rows = []
    for ctx in contexts:
        for B in batches:
            M = ctx // PAGE
            summaries = torch.randn(B * M, H, 2, D, dtype=DTYPE, device=DEVICE)
            codes = empty_codes(B * M, H, PAGE, D, DEVICE)
            codes.random_(0, 256)
            page_table = torch.randperm(B * M, device=DEVICE).int().view(B, M)
            req_slots = torch.arange(B, dtype=torch.int32, device=DEVICE)
            cand_end = torch.full((B,), M, dtype=torch.int32, device=DEVICE)
            q = torch.randn(B, HQ, D, dtype=DTYPE, device=DEVICE)
            slots = torch.full((B, H, k), -1, dtype=torch.int32, device=DEVICE)
            heads = torch.ones(B, H, dtype=torch.bool, device=DEVICE)  # every head selects (and is flagged)
            recall = torch.zeros(B, H, k, dtype=torch.int8, device=DEVICE)
            channel_codes = {}
            for r in channel_widths:
                cc = torch.randint(0, 256, (B * M, H, PAGE, r // 2), dtype=torch.uint8, device=DEVICE)
                ch = torch.stack([torch.randperm(D, device=DEVICE)[:r] for _ in range(H)]).int()
                channel_codes[f"channels{r}"] = (cc, ch, torch.rand(H, r, device=DEVICE) * 0.1 + 0.01)
            for selection in ("means", "quest", "sketch", *(f"rerank/{f}" for f in rerank_factors), *channel_codes):
                pooling = "max" if selection == "quest" else "mean_softmax"
                factor = int(selection.split("/")[1]) if selection.startswith("rerank") else None

                def score(pooling=pooling, factor=factor, selection=selection):
                    if selection in channel_codes:
                        cc, ch, step = channel_codes[selection]
                        return channel_sketch_pages(q, cc, ch, step, page_table, req_slots, D**-0.5, heads,
                                                    cand_start=0, cand_end=cand_end)
                    if selection == "sketch":
                        return sketch_pages(q, summaries, codes, page_table, req_slots, D**-0.5, nbytes, heads,
                                            cand_start=0, cand_end=cand_end)
                    if factor is None:
                        return score_pages(q, summaries, page_table, req_slots, 0, cand_end, D**-0.5, pooling, heads)
                    cand = None
                    if factor:
                        s = sketch_pages(q, summaries, codes, page_table, req_slots, D**-0.5, nbytes, heads,
                                         cand_start=0, cand_end=cand_end)
                        cand = top_pages(s, factor * k, heads)
                    return rerank_pages(q, summaries, codes, page_table, req_slots, cand, D**-0.5, heads,
                                        cand_start=0, cand_end=cand_end)

                def select(scores, slots=slots, req_slots=req_slots, heads=heads, recall=recall):
                    select_slots(scores, slots, req_slots, heads, PHASE_NOW, heads, recall)

                def run(score=score, select=select):
                    select(score())

                scores = score()
                row = {"context": ctx, "batch": B, "pages_per_row": M, "k": k, "selection": selection,
                       "pooling": pooling, "sketch_channels": sketch_channels if factor or selection == "sketch" else 0}
                floor_bytes = summaries.numel() * summaries.element_size()
                if selection in channel_codes:  # the codes alone
                    floor_bytes = channel_codes[selection][0].numel()
                elif selection == "sketch":  # its code rows
                    floor_bytes += B * H * M * PAGE * nbytes
                elif factor:  # the sketch's code rows, then the candidates' codes
                    floor_bytes += B * H * M * PAGE * nbytes + B * H * min(factor * k, M) * PAGE * D // 4
                elif factor == 0:
                    floor_bytes += codes.numel()
                row["floor_us"] = 1e6 * floor_bytes / copy_gbps / 1e9
                row["eager_us"] = 1e3 * time_ms(lambda i: run(), repeats, warmup)
                try:
                    row["graph_us"] = 1e3 * graph_replay_ms(run, repeats)
                    row["score_graph_us"] = 1e3 * graph_replay_ms(score, repeats)
                    row["select_graph_us"] = 1e3 * graph_replay_ms(lambda: select(scores), repeats)
                except Exception as e:  # report, keep going: capture is a bonus measurement
                    row["graph_error"] = f"{type(e).__name__}: {e}"
                rows.append(row)
                if "graph_us" in row:
                    graph = (f"{row['graph_us']:>9.1f} {row['score_graph_us']:>9.1f} {row['select_graph_us']:>9.1f} "
                             f"{row['floor_us']:>9.1f} {row['graph_us'] / row['floor_us']:>7.1f}x")
                else:
                    graph = f"{'failed':>9} ({row['graph_error']})"
                print(f"{ctx:>8} {B:>6} {selection:>14} {row['eager_us']:>9.1f} {graph}")
            # The realistic mode's own launch (benchmarks only: --kv-bench-churn), what it adds to each selection.
            draws = torch.rand(B, H, device=DEVICE)
            row = {"context": ctx, "batch": B, "pages_per_row": M, "k": k, "selection": "replay_churn"}
            row["eager_us"] = 1e3 * time_ms(
                lambda i: replay_churn(scores, slots, req_slots, heads, PHASE_NOW, draws, 0.15), repeats, warmup)
            row["graph_us"] = 1e3 * graph_replay_ms(
                lambda: replay_churn(scores, slots, req_slots, heads, PHASE_NOW, draws, 0.15), repeats)
            rows.append(row)
            print(f"{ctx:>8} {B:>6} {'replay_churn':>14} {row['eager_us']:>9.1f} {row['graph_us']:>9.1f}")
            del summaries, codes, page_table, q, scores, channel_codes
    return rows


def bench_topk_stages(contexts: list[int], batches: list[int], budget: int, chunks: list[int], repeats: int) -> list:
    """select_slots alone, its top-k staged as the launcher stages it (one program per row and head sorts a whole
    row of up to TOPK_SINGLE pages) against a first stage over chunks of C pages (TOPK_SINGLE = TOPK_CHUNK = C):
    at one request 8 programs sort ~1,000 scores each while the GPU idles, and before attention that sort is on
    the critical path. GPU time per call, from the replay of a graph of 32 calls (a step's sparse layers)."""
    import freekv_kernels.page_select.triton as pst
    from freekv_kernels.page_select import PHASE_NOW, select_slots

    k = budget // PAGE
    print(f"\nselect_slots per call (graph of 32 calls), k={k} pages, every head selecting; staged: today's launcher, "
          f"C: first stage over chunks of C pages")
    print(f"{'context':>8} {'batch':>6} {'staging':>8} {'us':>8} {'x today':>8}")
    rows = []
    for ctx in contexts:
        for B in batches:
            M = ctx // PAGE
            scores = torch.rand(B, H, M, device=DEVICE)
            slots = torch.full((B, H, k), -1, dtype=torch.int32, device=DEVICE)
            req_slots = torch.arange(B, dtype=torch.int32, device=DEVICE)
            heads = torch.ones(B, H, dtype=torch.bool, device=DEVICE)
            recall = torch.zeros(B, H, k, dtype=torch.int8, device=DEVICE)
            base = None
            for chunk in [0, *chunks]:
                saved = pst.TOPK_SINGLE, pst.TOPK_CHUNK
                if chunk:
                    pst.TOPK_SINGLE = pst.TOPK_CHUNK = chunk
                try:
                    us = 1e3 * graph_replay_ms(
                        lambda: [select_slots(scores, slots, req_slots, heads, PHASE_NOW, heads, recall)
                                 for _ in range(32)], repeats) / 32
                finally:
                    pst.TOPK_SINGLE, pst.TOPK_CHUNK = saved
                base = base or us
                rows.append({"context": ctx, "batch": B, "chunk": chunk, "us": us, "x_today": us / base})
                print(f"{ctx:>8} {B:>6} {chunk or 'today':>8} {us:>8.1f} {us / base:>8.2f}")
    return rows


def write_json(path: Path, results: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2) + os.linesep)


def int_list(s: str) -> list[int]:
    return [int(x) for x in s.split(",")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="results/kernels.json", help="JSON results path")
    ap.add_argument("--repeats", type=int, default=20, help="timed calls per measurement (the median is reported)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--peak-gib", type=float, default=2.0, help="size of the link-peak copy")
    ap.add_argument("--arena-gib", type=float, default=4.0, help="pinned host arena that recall gathers from")
    ap.add_argument("--host-dtype", choices=HOST_DTYPES, default="auto",
                    help="the arena's dtype (--kv-host-dtype): auto is bf16, as the GPU cache")
    ap.add_argument("--recall-chunks", type=int_list, default=[512, 1024, 2048, 4096, 8192, 16384])
    ap.add_argument("--offload-pages", type=int_list, default=[64, 512, 2048])
    ap.add_argument("--contexts", type=int_list, default=[32 * 1024, 128 * 1024])
    ap.add_argument("--batches", type=int_list, default=[1, 16])
    ap.add_argument("--budget", type=int, default=2048, help="selection budget in tokens (k = budget / page size)")
    ap.add_argument("--rerank-factors", type=int_list, default=[2, 4, 0],
                    help="rerank selections to time: N > 0 the sketch then N*k candidates, 0 every page's codes")
    ap.add_argument("--sketch-channels", type=int, default=DEFAULT_SKETCH_CHANNELS,
                    help="key channels the sketch (of sketch and rerank) reads")
    ap.add_argument("--channel-widths", type=int_list, default=[32],
                    help="calibrated channels of the channel sketches to time (multiples of 32)")
    ap.add_argument("--only-selection", action="store_true", help="skip the link, recall and offload benchmarks")
    ap.add_argument("--recall-blocks", action="store_true", help="also time the recall before attention")
    ap.add_argument("--only-recall-blocks", action="store_true", help="the link and the recall before attention only")
    ap.add_argument("--only-topk-stages", action="store_true",
                    help="select_slots alone: today's top-k staging against first stages of --topk-chunks pages")
    ap.add_argument("--topk-chunks", type=int_list, default=[512, 256, 128])
    ap.add_argument("--recall-batch", type=int, default=16, help="rows of the recall before attention")
    ap.add_argument("--recall-flagged", type=float, default=0.3, help="flagged share of (row, KV head) pairs")
    ap.add_argument("--recall-changed", type=float, default=0.33, help="changed share of a flagged pair's slots")
    ap.add_argument("--recall-programs", type=int_list, default=[132, 264, 528, 1056])
    ap.add_argument("--recall-slot-blocks", type=int_list, default=[1, 4, 16, 64])
    ap.add_argument("--only-recall-beside", action="store_true",
                    help="the link and the speculative recall beside GEMMs or an HBM copy only")
    ap.add_argument("--spec-changed", type=float, default=0.13,
                    help="changed share of every pair's slots in the speculative recall (served: ~8 of 64 at 16 x 32K)")
    ap.add_argument("--spec-programs", type=int_list, default=[32, 132, 0],
                    help="programs of the speculative recall (0: one per item)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/kernels.py needs a CUDA device")

    env = {
        "gpu": torch.cuda.get_device_name(DEVICE),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "shapes": {"Hq": HQ, "H": H, "D": D, "page_size": PAGE, "dtype": str(DTYPE), "chunk_bytes": CHUNK_BYTES,
                   "host_dtype": args.host_dtype},
    }
    print(f"{env['gpu']}  torch {env['torch']}  triton {env['triton']}  CUDA {env['cuda']}")
    print(f"shapes: {env['shapes']}")
    results = {"env": env, "args": vars(args), "correctness": check_correctness()}

    if args.only_topk_stages:
        batches = sorted({1, 4, *args.batches})
        results["topk_stages"] = bench_topk_stages(args.contexts, batches, args.budget, args.topk_chunks, args.repeats)
        write_json(Path(args.out), results)
        return
    results["link"] = bench_link(args.peak_gib, args.repeats)
    link, reps = results["link"], (args.repeats, args.warmup)
    if args.only_selection:
        results["selection"] = bench_select(args.contexts, args.batches, args.budget, *reps, link["d2d_gbps"],
                                            tuple(args.rerank_factors), args.sketch_channels,
                                            tuple(args.channel_widths))
        write_json(Path(args.out), results)
        return
    # The arena's content is irrelevant to a copy's speed: left unfilled, it costs only the pinning.
    host_layer = HostLayer(max(int(args.arena_gib * GiB) // (H * CHUNK_BYTES), max(args.offload_pages)),
                           str(DTYPE) if args.host_dtype == "auto" else args.host_dtype, H, PAGE, D)
    if args.recall_blocks or args.only_recall_blocks:
        results["recall_blocks"] = bench_recall_blocks(host_layer, args.recall_batch, args.recall_flagged,
                                                       args.recall_changed, args.recall_programs,
                                                       args.recall_slot_blocks, link["h2d_gbps"], *reps)
    if args.only_recall_blocks:
        write_json(Path(args.out), results)
        return
    if args.only_recall_beside:
        results["recall_beside"] = bench_recall_beside(host_layer, args.recall_batch, args.spec_changed,
                                                       args.spec_programs, link["h2d_gbps"], *reps)
        write_json(Path(args.out), results)
        return
    results["recall"] = bench_recall(host_layer, args.recall_chunks, link["h2d_gbps"], *reps)
    results["offload"] = bench_offload(host_layer, args.offload_pages, link["d2h_gbps"], *reps)
    del host_layer
    results["selection"] = bench_select(args.contexts, args.batches, args.budget, *reps, link["d2d_gbps"],
                                        tuple(args.rerank_factors), args.sketch_channels,
                                            tuple(args.channel_widths))

    write_json(Path(args.out), results)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
