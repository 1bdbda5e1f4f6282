"""One thread's timeline from a stack probe's file (benchmarks/stack_probe/sitecustomize.py):

    python3 benchmarks/stack_probe/timeline.py PROBE_DIR/stacks-PID.txt [--thread MainThread] [--frames 6]

prints, per sample, the seconds since the first sample and the innermost frames (innermost first)."""

from __future__ import annotations

import argparse
import re

FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')


def timeline(text: str, thread: str = "MainThread", frames: int = 6) -> list[tuple[float, list[str]]]:
    rows, t0 = [], None
    for sample in text.split("=== ")[1:]:
        t = float(sample.split(None, 1)[0])
        t0 = t if t0 is None else t0
        for block in sample.split("--- thread ")[1:]:
            name, _, body = block.partition("\n")
            if name == thread:
                found = FRAME.findall(body)[-frames:]
                rows.append((t - t0, [f"{path.rsplit('/', 1)[-1]}:{line}:{fn}" for path, line, fn in reversed(found)]))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stacks")
    ap.add_argument("--thread", default="MainThread")
    ap.add_argument("--frames", type=int, default=6)
    args = ap.parse_args()
    with open(args.stacks) as f:
        for t, frames in timeline(f.read(), args.thread, args.frames):
            print(f"{t:7.2f}  {' < '.join(frames)}")


if __name__ == "__main__":
    main()
