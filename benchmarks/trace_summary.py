"""Where the time of a profiled server window goes: a torch-profiler trace (SGLang's /start_profile) summarised.

    python3 benchmarks/trace_summary.py TRACE.json[.gz] [--top 25] [--match freekv,sglang/srt]

Prints, over the trace's window: the span of CPU and GPU activity, GPU busy time (kernels and copies merged), the
kernels and copies by total time, the CUDA runtime calls that block (synchronize, blocking copies, and launches that
took over 0.1 ms: a launch waits once the driver's queue of pending work is full) by total time and by the innermost
--match Python function they ran in (traces recorded with_stack),
and the Python functions (traces recorded with_stack) whose file matches --match by inclusive time. Inclusive times
of nested calls overlap, so read the Python table top-down, as a profile's call tree.
Then, per GPU stream: its busy time (its kernels and copies merged), its share of the GPU span, and its kernels by
total time; --steps N divides every time by the N steps the window holds (a profile of N decode steps), so the
streams of a decode step read as ms per step. In a CUDA-graph replay the trace's streams are the graph's own lanes,
which follow its branches (e.g. the critical chain with the selection before attention, the speculative selection,
the speculative recall), not the streams the graph was captured from.
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import defaultdict


# A kernel or graph launch takes a few µs of host time; one far longer waited for room in the launch queue.
LONG_LAUNCH_US = 100


def load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X" and "dur" in e]


def merged_busy(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of [start, end) intervals."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def table(title: str, totals: dict[str, list[float]], top: int) -> None:
    print(f"\n{title}")
    print(f"{'ms':>9} {'calls':>6}  name")
    for name, (ms, n) in sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"{ms:9.2f} {int(n):6d}  {name[:150]}")


def blocking_callers(blocking: list[dict], python: list[dict]) -> dict[str, list[float]]:
    """Blocking calls summed by the innermost Python function (of those given) that encloses each on its thread."""
    by_tid: dict = defaultdict(list)
    for f in python:
        by_tid[f.get("tid")].append(f)
    sums: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in blocking:
        around = [f for f in by_tid[e.get("tid")] if f["ts"] <= e["ts"] and e["ts"] + e["dur"] <= f["ts"] + f["dur"]]
        caller = min(around, key=lambda f: f["dur"])["name"] if around else "(no Python caller recorded)"
        row = sums[f"{e['name']} in {caller}"]
        row[0] += e["dur"] / 1e3
        row[1] += 1
    return sums


def streams(gpu: list[dict], steps: int, top: int) -> None:
    """Per stream: busy (merged) and kernel totals, per step."""
    by: dict = defaultdict(list)
    for e in gpu:
        by[e.get("args", {}).get("stream", "?")].append(e)
    lo, hi = min(e["ts"] for e in gpu), max(e["ts"] + e["dur"] for e in gpu)
    print(f"\nGPU streams over {steps} step(s), ms per step (GPU span {(hi - lo) / 1e3 / steps:.3f} ms per step)")
    print(f"{'stream':>8} {'busy':>9} {'share':>6} {'kernels':>8}  top kernels (ms per step)")
    for sid, es in sorted(by.items(), key=lambda kv: -merged_busy([(e["ts"], e["ts"] + e["dur"]) for e in kv[1]])):
        busy = merged_busy([(e["ts"], e["ts"] + e["dur"]) for e in es]) / 1e3
        names: dict = defaultdict(float)
        for e in es:
            names[e["name"]] += e["dur"] / 1e3
        tops = ", ".join(f"{n[:60]} {t / steps:.3f}" for n, t in sorted(names.items(), key=lambda kv: -kv[1])[:top])
        print(f"{sid!s:>8} {busy / steps:9.3f} {busy / ((hi - lo) / 1e3):6.1%} {len(es) / steps:8.1f}  {tops}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--match", default="freekv,sglang/srt", help="comma-separated substrings of Python file names")
    ap.add_argument("--steps", type=int, default=1, help="steps in the trace's window: the stream table per step")
    ap.add_argument("--stream-top", type=int, default=6, help="kernels named per stream")
    args = ap.parse_args()
    events = load(args.trace)
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    cpu = [e for e in events if e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset")]
    span = lambda es: (max(e["ts"] + e["dur"] for e in es) - min(e["ts"] for e in es)) / 1e3 if es else 0.0
    print(f"CPU span {span(cpu):.2f} ms, GPU span {span(gpu):.2f} ms, GPU busy "
          f"{merged_busy([(e['ts'], e['ts'] + e['dur']) for e in gpu]) / 1e3:.2f} ms")
    if gpu and cpu:
        start = (min(e["ts"] for e in gpu) - min(e["ts"] for e in cpu)) / 1e3
        end = (max(e["ts"] + e["dur"] for e in cpu) - max(e["ts"] + e["dur"] for e in gpu)) / 1e3
        print(f"GPU activity starts {start:.2f} ms into the CPU window and ends {end:.2f} ms before its end")
    sums: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0.0, 0]))
    keys = [k for k in args.match.split(",") if k]
    picked: dict[str, list[dict]] = defaultdict(list)
    for e in events:
        cat, name = e.get("cat", ""), e["name"]
        if cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            group = "gpu"
        elif cat == "cuda_runtime" and any(s in name for s in ("Synchronize", "Memcpy", "EventSynchronize")):
            group = "blocking"
        elif cat in ("cuda_runtime", "cuda_driver") and "Launch" in name and e["dur"] > LONG_LAUNCH_US:
            group = "blocking"
        elif cat == "python_function" and any(k in name for k in keys):
            group = "python"
        else:
            continue
        picked[group].append(e)
        row = sums[group][name]
        row[0] += e["dur"] / 1e3
        row[1] += 1
    table("GPU kernels and copies", sums["gpu"], args.top)
    table("CUDA runtime calls that may block", sums["blocking"], args.top)
    if picked["python"]:
        table("... by the innermost Python function they ran in", blocking_callers(picked["blocking"],
                                                                                  picked["python"]), args.top)
    table(f"Python functions in {args.match} (inclusive)", sums["python"], args.top)
    if gpu:
        streams(gpu, max(args.steps, 1), args.stream_top)


if __name__ == "__main__":
    main()
