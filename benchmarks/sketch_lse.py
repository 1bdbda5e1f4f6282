"""The channel sketch's scoring alone on a GPU: per-page log-sum-exps (channel_sketch_pages with pool=False, what
select_chain takes), one call per layer timed as the replay of a CUDA graph of --layers calls (a step's sparse
layers), for the heads that select before attention (a share --flagged of them) and for every head (the speculative
phase). 32 channels of 4-bit codes, pages of 32 tokens; shapes: llama (8 KV heads, groups of 4), qwen (4, groups of 7).

--launch sweeps the launch: TOKENS/BLOCKS/WARPS/STAGES (tokens a block, blocks a program, warps, pipeline stages;
the served one is kernels/channel_sketch/triton.py's CHANNEL_*). --module times another copy of that module (e.g.
`git show REF:kernels/channel_sketch/triton.py > /tmp/old.py`) beside the installed one, on the same inputs, and
checks the two agree. Prints a table and writes JSON.

python benchmarks/sketch_lse.py --shapes llama,qwen --batches 16,1 --module /tmp/old.py
python benchmarks/sketch_lse.py --shapes qwen --batches 16 --launch 512/2/4/2,256/2/4/2,512/1/4/1,1024/2/8/2
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import torch
from freekv_kernels.channel_sketch import triton as served
from gpu_timing import graph_replay_ms

SHAPES = {"llama": (8, 4), "qwen": (4, 7)}  # KV heads, group
D, PAGE, R = 128, 32, 32
LAUNCH = ("CHANNEL_TOKENS", "CHANNEL_BLOCKS", "CHANNEL_WARPS", "CHANNEL_STAGES")


def load(path: str):
    """A copy of the kernel module, loaded inside the package so that its relative imports resolve."""
    name = "freekv_kernels.channel_sketch._alt"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def case(shape: str, batch: int, pages: int, flagged: float, seed: int, dev: str = "cuda") -> dict:
    H, G = SHAPES[shape]
    gen = torch.Generator().manual_seed(seed)
    n = batch * pages
    return dict(
        q=torch.randn(batch, H * G, D, generator=gen).to(dev, torch.bfloat16),
        codes=torch.randint(0, 256, (n, H, PAGE, R // 2), generator=gen, dtype=torch.uint8).to(dev),
        channels=torch.stack([torch.randperm(D, generator=gen)[:R] for _ in range(H)]).int().to(dev),
        step=(torch.rand(H, R, generator=gen) * 0.1 + 0.01).to(dev),
        page_table=torch.randperm(n, generator=gen).int().view(batch, pages).to(dev),
        req_slots=torch.arange(batch, dtype=torch.int32, device=dev),
        cand_end=torch.full((batch,), pages, dtype=torch.int32, device=dev),
        heads=(torch.rand(batch, H, generator=gen) < flagged).to(dev),
    )


def lse(module, c: dict) -> torch.Tensor:
    return module.channel_sketch_pages(c["q"], c["codes"], c["channels"], c["step"], c["page_table"], c["req_slots"],
                                       D**-0.5, c["heads"], cand_end=c["cand_end"], pool=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="llama,qwen")
    ap.add_argument("--batches", default="16,1")
    ap.add_argument("--pages", default="1000", help="candidate pages a row (3750: 120K), comma-separated")
    ap.add_argument("--flagged", default="0.3,1", help="shares of (row, KV head) pairs that score, comma-separated")
    ap.add_argument("--launch", default="",
                    help="TOKENS/BLOCKS/WARPS/STAGES launches, comma-separated (default: served)")
    ap.add_argument("--module", default="", help="another copy of kernels/channel_sketch/triton.py to time beside")
    ap.add_argument("--layers", type=int, default=32, help="calls in the timed graph")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--out", default="results/sketch_lse.json")
    args = ap.parse_args()
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    served_launch = tuple(getattr(served, a) for a in LAUNCH)
    launches = [tuple(int(x) for x in s.split("/")) for s in args.launch.split(",") if s] or [served_launch]
    modules = [("now", served)] + ([("other", load(args.module))] if args.module else [])
    print(f"{torch.cuda.get_device_name()}; served launch {'/'.join(map(str, served_launch))}; µs a call "
          f"(graph of {args.layers}); rate: scored (page, KV head) pairs a second")
    print(f"{'shape':>6} {'batch':>5} {'pages':>5} {'flagged':>7} {'launch':>12} {'module':>6} {'us':>8} "
          f"{'G pairs/s':>9}")
    rows = []
    for shape in args.shapes.split(","):
        for batch in ints(args.batches):
            for pages in ints(args.pages):
                for flagged in (float(x) for x in args.flagged.split(",")):
                    c = case(shape, batch, pages, flagged, seed=batch * 7919 + pages)
                    pairs = int(c["heads"].sum()) * pages
                    for launch in launches:
                        ref = None
                        for name, module in modules:
                            for attr, value in zip(LAUNCH, launch):
                                setattr(module, attr, value)
                            out = lse(module, c)
                            if ref is None:
                                ref = out
                            else:  # the modules must agree where a head scored (elsewhere the scratch is unwritten)
                                on = (c["heads"][:, :, None, None] & (torch.arange(out.shape[3], device=out.device)
                                                                       < SHAPES[shape][1])).expand_as(out)
                                torch.testing.assert_close(out[on], ref[on], rtol=1e-3, atol=1e-3)
                            calls = [c] * args.layers
                            us = graph_replay_ms(lambda: [lse(module, x) for x in calls], args.repeats)
                            us *= 1e3 / args.layers
                            row = dict(shape=shape, batch=batch, pages=pages, flagged=flagged, pairs=pairs,
                                       launch="/".join(map(str, launch)), module=name, us=us,
                                       gpairs_per_s=pairs / us / 1e3)
                            rows.append(row)
                            print(f"{shape:>6} {batch:>5} {pages:>5} {flagged:>7.2f} {row['launch']:>12} {name:>6} "
                                  f"{us:>8.2f} {row['gpairs_per_s']:>9.2f}")
                        for attr, value in zip(LAUNCH, served_launch):
                            setattr(served, attr, value)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "args": vars(args), "rows": rows},
                                         indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
