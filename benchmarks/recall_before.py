"""The recall before attention alone on a GPU, as served: FP8 host pages with their row exponents (a pinned arena of
kvstore's layout), the victim cache (a changed slot's outgoing chunk to an entry, about `returns` of the incoming ones
from entries instead of the host), page 32, head dim 128, 64 slots a (row, KV head), at the Qwen2.5-7B (4 KV heads)
or Llama-3.1-8B (8) shape. One call a layer timed as the replay of a CUDA graph of 32 calls, each with its own draw
of flagged pairs (--flagged) and changed slots (--changed of a flagged pair's), per call µs, for:

  programs 0, block B   the launch served with --kv-recall-block B (0: one program per (row, head, slot), the
                        default; B: one per block of B slots, which walks its block's entries one after another)
  programs P            the capped speculative recall, served with --kv-recall-programs P (32 by default): P
                        programs, each walking whole (row, head) rows of slots one after another; time it as served
                        with --flagged 1 (every head reselects after attention)
  flagged 0             the same launch with nothing to recall: what its grid alone costs

and the link's own copy of as many bytes as a call reads from the host (one pinned copy_, the floor). Session 47's
trace: 22.4 µs a layer in the Qwen 16 x 32K step, for ~0.76 MB of host chunks; its one-slot programs take 126
registers (docs/results/session47/recall_sass.py), 4 to an SM, so the ~4,000 programs of a launch pass through
the SMs in ~8 waves, most of them exiting at once. Prints a table and writes JSON.

python benchmarks/recall_before.py --shape qwen --batches 16,1 --out results/recall_before.json
python benchmarks/recall_before.py --shape llama --batches 16 --flagged 1 --blocks 0 --programs 32,64
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
from freekv_kernels.page_select.naive import victim_op
from freekv_kernels.recall import recall_pages
from gpu_timing import graph_replay_ms, time_ms
from host_arena import HostLayer

SHAPES = {"llama": 8, "qwen": 4}  # KV heads
K, PAGE, D, V = 64, 32, 128, 64  # slots, page, head dim, victim entries a head (--kv-victim 2048)
CALLS = 32


def draws(batch: int, H: int, flagged: float, changed: float, returns: float, host_pages: int, seed: int) -> list:
    """CALLS recall_pages argument sets: slot tables over host pages, a changed slot's victim op evicting into a
    free entry and, with probability `returns`, sourcing from another (never one the head evicts into)."""
    g = torch.Generator().manual_seed(seed)
    sets = []
    for _ in range(CALLS):
        M = 4 * K
        page_table = torch.randint(0, host_pages, (batch, M), dtype=torch.int32, generator=g)
        slots = torch.stack([torch.randperm(M, generator=g)[:K] for _ in range(batch * H)]).view(batch, H, K).int()
        pairs = torch.rand(batch, H, generator=g) < flagged
        recall = (pairs[:, :, None] & (torch.rand(batch, H, K, generator=g) < changed)).to(torch.int8)
        ops = torch.zeros(batch, H, K, dtype=torch.int32)
        for b, h, s in recall.nonzero().tolist():
            n = int(ops[b, h].ne(0).sum())  # entries 2n, 2n + 1: one to evict into, one to read from
            ops[b, h, s] = victim_op(2 * n % V, (2 * n + 1) % V if torch.rand(1, generator=g) < returns else -1)
        sets.append([t.cuda() for t in (page_table, slots, torch.arange(batch, dtype=torch.int32),
                                        torch.arange(batch * K, dtype=torch.int32).view(batch, K), recall, ops)])
    return sets


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=SHAPES, default="qwen")
    ap.add_argument("--batches", default="16,1")
    ap.add_argument("--flagged", type=float, default=0.3, help="share of (row, KV head) pairs recalling")
    ap.add_argument("--changed", type=float, default=0.15, help="changed share of a recalling pair's slots")
    ap.add_argument("--returns", type=float, default=0.5, help="share of the changed slots read from victim entries")
    ap.add_argument("--blocks", default="0,2,4,8,16", help="--kv-recall-block values, comma-separated")
    ap.add_argument("--programs", default="", help="--kv-recall-programs values (the speculative recall's cap), "
                    "comma-separated")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--out", default="results/recall_before.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/recall_before.py needs a CUDA device")
    H = SHAPES[args.shape]
    host_pages = 8192
    arena = HostLayer(host_pages, "float8_e4m3fn", H, PAGE, D)
    layer, scales = arena.layer, arena.scales
    chunk = arena.chunk_bytes  # one (page, KV head): K and V and their row exponents
    ints = lambda text: [int(x) for x in text.split(",") if x]  # noqa: E731
    launches = [(0, b) for b in ints(args.blocks)] + [(n, 0) for n in ints(args.programs) if n > 0]
    names = [f"programs {n}" if n else f"block {b}" for n, b in launches]
    print(f"{torch.cuda.get_device_name()}: the recall before attention per call (graph of {CALLS}), {H} KV heads, "
          f"{K} slots, flagged {args.flagged}, changed {args.changed}, returns {args.returns}, FP8 host pages")
    print(f"{'batch':>5} {'host KB':>8} {'link µs':>8} " + " ".join(f"{name:>11}" for name in names)
          + " " + " ".join(f"{'empty ' + name.split()[-1]:>9}" for name in names))
    rows = []
    for batch in ints(args.batches):
        k, v = torch.zeros(2, (batch * K + batch * V) * PAGE, H, D, dtype=torch.bfloat16, device="cuda")
        row = dict(shape=args.shape, batch=batch)
        for flagged, key in ((args.flagged, "us"), (0.0, "empty_us")):
            sets = draws(batch, H, flagged, args.changed, args.returns, host_pages, seed=batch)
            if flagged:
                host = statistics.mean(int(((s[4] == 1) & ((s[5] >> 16) == 0)).sum()) for s in sets) * chunk
                src = torch.empty(max(int(host), 1), dtype=torch.uint8, pin_memory=True)
                dst = torch.empty_like(src, device="cuda")
                row["host_bytes"] = host
                row["link_us"] = 1e3 * time_ms(lambda i: dst.copy_(src, non_blocking=True), args.repeats, 3, True)
            for (programs, block), name in zip(launches, names):
                def run(programs=programs, block=block, sets=sets):
                    for s in sets:
                        recall_pages(layer, k, v, *s[:5], 1, PAGE, programs=programs, slot_block=block,
                                     victim_ops=s[5], victim_base=batch * K, victim_entries=V, host_scales=scales)
                row[f"{key}_{name.replace(' ', '_')}"] = 1e3 * graph_replay_ms(run, args.repeats) / CALLS
        rows.append(row)
        cols = [name.replace(" ", "_") for name in names]
        print(f"{batch:>5} {row['host_bytes'] / 1e3:>8.0f} {row['link_us']:>8.1f} "
              + " ".join(f"{row[f'us_{c}']:>11.1f}" for c in cols) + " "
              + " ".join(f"{row[f'empty_us_{c}']:>9.1f}" for c in cols))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "args": vars(args), "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
