"""A served decode step's sparse layer split into its parts, from a profiled trace (decode.py --profile-steps).

    python3 benchmarks/trace_layers.py TRACE.json[.gz] [--layers 32] [--qkv PREFIX] ...

A layer runs from one QKV projection's start to the next. Per layer, on the chain the model's kernels form:
the QKV projection; FreeKV's correction chain (from the query-similarity kernel's end to attention's start) and the
recall inside it; attention (FlashInfer's kernel and its merge, or with --kv-attention split from attend_kept's start
to attend_recalled's end, the recall before attention running beside attend_kept; `recalled` is attend_recalled alone,
0 for FlashInfer); the idle time before the output projection; the output, gate/up and down projections. Prints each
part's median and mean over every sparse layer of the window (the first layer, dense, and the last, which runs the LM
head, are left out), then the kernels that start inside the correction chain, by stream (which of them the chain
waits for: a speculative lane's kernels start there too), and those that overlap the idle time before the output
projection. The QKV projection, which delimits layers, is the GEMM that most often starts last before attention
(cuBLAS names its kernel by the tiles it picks for the batch; --qkv gives a name prefix instead). The output, gate/up
and down projections are the first three GEMMs after attention's merge (cuBLAS picks their tiles per machine and
library: session 39's H200 chose others than session 30's); --oproj, --gateup and --down name them by prefix
instead. With --kv-correct-at previous_mlp(_only), the next layer's early lane beside the MLP (a second similarity
check in the window): early_lane, from gate-up's start to that lane's recall's end, and early_past_mlp, how far that
end lies past the down projection's (> 0: the next layer's attention may wait for it); its predicted query's GEMM is
not taken for the down projection where the graph replays the lane on a stream of its own. The lane's recall is the
one the next layer's attention waits for (_early_recall): a replayed graph's streams do not say which recall is whose.
"""

from __future__ import annotations

import argparse
import bisect
import itertools
import statistics
from collections import Counter, defaultdict

from trace_summary import load

GPU = ("kernel", "gpu_memcpy")
PARTS = ("layer", "qkv", "chain", "chain_recall", "attention", "recalled", "idle_before_oproj", "oproj", "gate_up",
         "down")
# With --kv-correct-at previous_mlp(_only): the next layer's check, selection and recall beside this layer's MLP,
# from gate-up's start (the mid residual it forks at) to its recall's end, and how far that end lies past the MLP's.
EARLY_PARTS = ("early_lane", "early_past_mlp")


def _first(events, pred, after, skip_stream=None):
    return next(e for e in events if e["ts"] > after and pred(e["name"]) and _stream(e) != skip_stream)


def _stream(e: dict):
    return e.get("args", {}).get("stream", e.get("tid"))


def _is_gemm(name: str) -> bool:
    """cuBLAS's GEMM kernels (nvjet on Hopper, *gemm* / cutlass elsewhere), not its split-K reductions."""
    low = name.lower()
    return (low.startswith("nvjet") or "gemm" in low or "cutlass" in low) and "splitkreduce" not in low


def _gemm(names: dict, key: str):
    prefix = names.get(key)
    return _is_gemm if prefix is None else (lambda n: n.startswith(prefix))


def _is_attention(name: str) -> bool:
    """A sparse layer's attention: FlashInfer's kernel, or with --kv-attention split attend_kept."""
    return "BatchPrefill" in name or "BatchDecode" in name or name == "_attend_kept_kernel"


def qkv_name(events: list[dict]) -> str | None:
    """The QKV projection's kernel name: the GEMM that most often starts last before attention. (Not before the
    similarity check: with --kv-correct-at previous_mlp(_only) the predicted query's projection precedes one too.)"""
    before, last = Counter(), None
    for e in sorted((e for e in events if e.get("cat") in GPU), key=lambda e: e["ts"]):
        if _is_gemm(e["name"]):
            last = e["name"]
        elif _is_attention(e["name"]) and last is not None:
            before[last] += 1
            last = None
    return before.most_common(1)[0][0] if before else None


def _grid(e: dict) -> int:
    """A kernel event's programs (the profiler's grid), 0 where the trace does not say."""
    g = e.get("args", {}).get("grid")
    return g[0] * g[1] * g[2] if isinstance(g, list) and len(g) == 3 else 0


def _early_recall(after: list[dict], next_qkv: float) -> dict | None:
    """The early lane's recall among the events `after` its check: what the next layer's attention waits for. Of the
    recalls that start before the next layer's first similarity check (a correction after the projection, with
    previous_mlp, recalls later) and end before that attention starts, the one with the most programs (the lane
    recalls with one a slot, the speculative recall with --kv-recall-programs), the last to end among equals. Not the
    first recall on the check's stream: a replayed graph runs other layers' recalls on that stream too."""
    nxt = sim = None
    for e in after:
        if e["ts"] > next_qkv and sim is None and e["name"] == "_query_similarity_kernel":
            sim = e
        if e["ts"] > next_qkv and _is_attention(e["name"]):
            nxt = e
            break
    if nxt is None:
        return None
    recs = [e for e in itertools.takewhile(lambda e: e["ts"] < nxt["ts"], after)
            if e["name"] == "_recall_pages_kernel" and (sim is None or e["ts"] < sim["ts"])
            and e["ts"] + e["dur"] <= nxt["ts"] + 0.5]
    return max(recs, key=lambda e: (_grid(e), e["ts"] + e["dur"]), default=None)


def split_layers(events: list[dict], layers: int, names: dict[str, str]) -> tuple[list[dict], Counter, Counter, dict]:
    """(per sparse layer {part: µs}, kernels overlapping the idle before the output projection: count, µs, and
    {(kernel, stream): [µs of each]} of the kernels that start inside the correction chain). names["qkv"] None: the
    QKV projection found by qkv_name."""
    ev = sorted((e for e in events if e.get("cat") in GPU), key=lambda e: e["ts"])
    starts = [e["ts"] for e in ev]
    prefix = names.get("qkv") or qkv_name(ev)
    qkv = [e for e in ev if prefix is not None and e["name"].startswith(prefix)]
    rows, seen, overlap, inside = [], Counter(), Counter(), defaultdict(list)
    for i in range(len(qkv) - 1):
        if i % layers in (0, layers - 1):
            continue
        t0, t1 = qkv[i]["ts"], qkv[i + 1]["ts"]
        win = [e for e in ev if t0 <= e["ts"] < t1]
        sim = _first(win, lambda n: n == "_query_similarity_kernel", t0 - 1)
        att = _first(win, _is_attention, sim["ts"])
        split = att["name"] == "_attend_kept_kernel"
        merge = _first(win, lambda n: n == "_attend_recalled_kernel" if split else "MergeStates" in n, att["ts"])
        oproj = _first(win, _gemm(names, "oproj"), merge["ts"])
        gate = _first(win, _gemm(names, "gateup"), oproj["ts"])
        # A second similarity check is the next layer's, made early; its lane's GEMM (the predicted query's
        # projection) is not the down projection, when the graph replays the lane on a stream of its own.
        early = next((e for e in win if e["name"] == "_query_similarity_kernel" and e["ts"] > gate["ts"]), None)
        lane = None if early is None or _stream(early) == _stream(gate) else _stream(early)
        down = _first(win, _gemm(names, "down"), gate["ts"], skip_stream=lane)
        chain_start, idle = sim["ts"] + sim["dur"], (merge["ts"] + merge["dur"], oproj["ts"])
        recall = sum(e["dur"] for e in win if e["name"] == "_recall_pages_kernel" and e["ts"] >= chain_start
                     and e["ts"] + e["dur"] <= (merge if split else att)["ts"] + 0.5)
        rows.append(dict(layer=t1 - t0, qkv=qkv[i]["dur"], chain=att["ts"] - chain_start, chain_recall=recall,
                         attention=merge["ts"] + merge["dur"] - att["ts"], recalled=merge["dur"] if split else 0,
                         idle_before_oproj=idle[1] - idle[0], oproj=oproj["dur"], gate_up=gate["dur"],
                         down=down["dur"]))
        if early is not None:
            rec = _early_recall(ev[bisect.bisect_right(starts, early["ts"]):], qkv[i + 1]["ts"])
            if rec is not None:
                end = rec["ts"] + rec["dur"]
                rows[-1].update(early_lane=end - gate["ts"], early_past_mlp=end - down["ts"] - down["dur"])
        for e in win:
            if chain_start <= e["ts"] < att["ts"]:
                inside[(e["name"], _stream(e))].append(e["dur"])
        for e in ev:
            if e is not merge and e["ts"] < idle[1] and e["ts"] + e["dur"] > idle[0]:
                seen[e["name"]] += 1
                overlap[e["name"]] += min(idle[1], e["ts"] + e["dur"]) - max(idle[0], e["ts"])
    return rows, seen, overlap, inside


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--layers", type=int, default=32, help="the model's layers")
    ap.add_argument("--qkv", help="name prefix (default: the GEMM that most often starts last before the similarity "
                    "check; cuBLAS picks its tiles per batch and machine)")
    ap.add_argument("--oproj", help="name prefix (default: the first GEMM after attention)")
    ap.add_argument("--gateup", help="name prefix (default: the next GEMM)")
    ap.add_argument("--down", help="name prefix (default: the next GEMM)")
    args = ap.parse_args()
    names = dict(qkv=args.qkv, oproj=args.oproj, gateup=args.gateup, down=args.down)
    rows, seen, overlap, inside = split_layers(load(args.trace), args.layers, names)
    if not rows:
        raise SystemExit(f"{args.trace}: no sparse layer found (check --layers and the kernel names)")
    print(f"{len(rows)} sparse layers, µs")
    print(f"{'part':20s} {'median':>8s} {'mean':>8s}")
    for part in PARTS + EARLY_PARTS:
        vals = [r[part] for r in rows if part in r]
        if vals:
            print(f"{part:20s} {statistics.median(vals):8.1f} {statistics.mean(vals):8.1f}")
    print("starting inside the correction chain (per layer: count, median µs, µs; stream)")
    for (name, stream), durs in sorted(inside.items(), key=lambda kv: -sum(kv[1]))[:8]:
        print(f"  {len(durs) / len(rows):5.2f} {statistics.median(durs):7.1f} {sum(durs) / len(rows):7.1f}  "
              f"{stream!s:>6}  {name[:70]}")
    print("overlapping the idle before the output projection (per layer: count, µs)")
    for name, n in seen.most_common(6):
        print(f"  {n / len(rows):5.2f} {overlap[name] / len(rows):7.1f}  {name[:80]}")


if __name__ == "__main__":
    main()
