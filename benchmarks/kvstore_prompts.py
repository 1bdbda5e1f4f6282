"""The kvstore calls of served prompts, timed one by one against an embedded daemon (CPU only): for each prompt of
--pages pages (1,000: 32K tokens at page 32) with the radix cache on, what FreeKV's scheduler side sends: LOOKUP of
its page keys (a miss), ALLOC of its pages past the sink, ALLOC of its sink pages (the export), RETAIN_CHAIN of its
keys, and FREE of the prompt before it (its retained pages stay cached). Every prompt's tokens differ, so the
daemon's retained keys grow by --pages a prompt. Prints p50 / p99 / max per call and writes JSON.

Its tail is what a prompt's time to first token may meet: the daemon's journal compaction and Python's garbage
collector run between or inside these calls. This process's own collector is off while it times them (in a server
the caller's collections are the scheduler process's, with its own heap).

    python benchmarks/kvstore_prompts.py --prompts 60 --out results/kvstore_prompts.json
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time
from pathlib import Path

from freekv_kvstore import ArenaGeometry, KVStoreClient, prefix_keys, start_embedded

SMALL = ArenaGeometry(num_layers=1, num_kv_heads=1, page_size=32, head_dim=16, dtype="bfloat16")  # calls, not bytes
SINK = 4


def run(prompts: int, pages: int, seed: int) -> dict:
    rng = random.Random(seed)
    calls: dict[str, list[float]] = {k: [] for k in ("lookup", "alloc", "alloc_sink", "retain_chain", "free")}

    def timed(name, fn, *args, **kw):
        t0 = time.perf_counter()
        out = fn(*args, **kw)
        calls[name].append(time.perf_counter() - t0)
        return out

    num_pages = (prompts + 2) * pages
    gc.disable()
    with start_embedded(arena_gb=num_pages * SMALL.page_bytes / 2**30 + 0.1, log_level="warning") as kv:
        with KVStoreClient.connect(kv.endpoint, geometry=SMALL, num_pages=num_pages, client_id="prompts") as c:
            for r in range(prompts):
                keys = prefix_keys([rng.randrange(128000) for _ in range(pages * SMALL.page_size)], SMALL.page_size,
                                   namespace=b"bench")
                timed("lookup", c.lookup_longest, keys, request_id=(1 << 40) | r)
                own = timed("alloc", c.alloc, r, pages - SINK)
                sink = timed("alloc_sink", c.alloc, r, SINK)
                timed("retain_chain", c.retain_chain, keys, sink + own)
                if r:
                    timed("free", c.free, r - 1)
            retained = c.stats()["arenas"][0]["prefixes"]
    out = {"prompts": prompts, "pages": pages, "retained_keys_at_end": retained, "calls": {}}
    for name, t in calls.items():
        ms = sorted(x * 1e3 for x in t)
        out["calls"][name] = {"p50_ms": statistics.median(ms), "p99_ms": ms[min(len(ms) - 1, int(0.99 * len(ms)))],
                              "max_ms": ms[-1], "n": len(ms), "over_10ms": sum(x > 10 for x in ms)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=60)
    ap.add_argument("--pages", type=int, default=1000, help="pages a prompt (1,000: 32K tokens at page 32)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="results/kvstore_prompts.json")
    args = ap.parse_args()
    res = run(args.prompts, args.pages, args.seed)
    print(f"{args.prompts} prompts of {args.pages} pages; {res['retained_keys_at_end']:,} keys retained at the end")
    print(f"{'call':>13} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'> 10 ms':>8}")
    for name, m in res["calls"].items():
        print(f"{name:>13} {m['p50_ms']:>8.2f} {m['p99_ms']:>8.2f} {m['max_ms']:>8.2f} {m['over_10ms']:>8}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), **res}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
