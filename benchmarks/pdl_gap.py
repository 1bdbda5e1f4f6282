"""The launch gap between dependent kernels in a CUDA graph, with and without programmatic dependent launch (PDL,
sm_90+): does letting each kernel's programs start while its predecessor finishes shorten a chain of small kernels
like the correction chain's (scoring, select_chain, recall, token lists), each of which waits for the last?

A graph of 32 calls, call i reading what call i - 1 wrote (ping-pong buffers), per call µs for:
  off      plain launches
  wait     launch_pdl, griddepcontrol.wait first in every program (the next grid launches when this one's
           programs have all exited)
  trigger  launch_pdl, griddepcontrol.launch_dependents then wait first in every program (the next grid's programs
           may be resident, waiting, before this one ends)
over programs per kernel (1, 64 like select_chain at 16 x 4 heads, 1,024, 4,096 like the scoring) and a dependent
FMA loop a program (work). The results must equal the plain chain's (checked). Prints a table, writes JSON.

python benchmarks/pdl_gap.py --out results/pdl_gap.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import triton
import triton.language as tl
from gpu_timing import graph_replay_ms
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

BLOCK = 256
MODES = ("off", "wait", "trigger")


@triton.jit
def _step_kernel(x_ptr, y_ptr, n, work, WAIT: tl.constexpr, TRIGGER: tl.constexpr, BLOCK: tl.constexpr):
    if TRIGGER:
        gdc_launch_dependents()
    if WAIT:
        gdc_wait()  # x is the previous call's output
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    for _ in range(work):
        v = v * 0.999 + 1.0
    tl.store(y_ptr + offs, v, mask=offs < n)


def chain(bufs: list[torch.Tensor], mode: str, work: int, calls: int = 32) -> None:
    n = bufs[0].numel()
    grid = (triton.cdiv(n, BLOCK),)
    for i in range(calls):
        _step_kernel[grid](bufs[i % 2], bufs[(i + 1) % 2], n, work, WAIT=mode != "off", TRIGGER=mode == "trigger",
                           BLOCK=BLOCK, num_warps=8, launch_pdl=mode != "off")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--programs", default="1,64,1024,4096")
    ap.add_argument("--work", default="0,256")
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    rows = []
    print(f"{torch.cuda.get_device_name()}: per call µs, graph of 32 dependent calls, 8 warps a program")
    print(f"{'programs':>8} {'work':>5} " + " ".join(f"{m:>8}" for m in MODES))
    for programs in map(int, args.programs.split(",")):
        for work in map(int, args.work.split(",")):
            row = dict(programs=programs, work=work)
            want = None
            gen = torch.Generator(device="cuda").manual_seed(programs)
            start = [torch.rand(programs * BLOCK, device="cuda", generator=gen) for _ in range(2)]
            for mode in MODES:
                bufs = [s.clone() for s in start]
                row[mode] = 1e3 * graph_replay_ms(lambda m=mode: chain(bufs, m, work), args.repeats) / 32
                for b, s in zip(bufs, start):
                    b.copy_(s)
                chain(bufs, mode, work)  # one eager chain from the same start: equal in every mode
                torch.cuda.synchronize()
                got = bufs[0].clone()
                want = got if want is None else want
                row[f"{mode}_equal"] = bool(torch.equal(got, want))
            rows.append(row)
            print(f"{programs:>8} {work:>5} " + " ".join(f"{row[m]:>8.2f}" for m in MODES)
                  + ("" if all(row[f"{m}_equal"] for m in MODES) else "  MISMATCH"))
    if args.out:
        args.out.write_text(json.dumps(dict(gpu=torch.cuda.get_device_name(), rows=rows), indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
