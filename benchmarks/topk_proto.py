"""Top-k prototypes for select_slots' one-stage top-k (1,024 packed keys, k 64, one program of 8 warps a row), to
time on a GPU before any of them replaces tl.topk in page_select: static SASS for sm_90 on any machine (instructions,
barriers), their output against torch.topk (on the CPU under TRITON_INTERPRET=1), and with a GPU each one's time
(graph replay) at a served step's row counts.

  bitonic    tl.topk over the row (what _select_row runs)
  per-warp   tl.topk over [8, 128] (each warp's own 128 keys), then over the 8 x 64 winners
  threshold  the 64th key's high word by four 8-bit histogram passes, the keys above it (ties by lane, as
             _sort_keys packs them: lower page first) stored and read back in lane order, then tl.sort of those 64

The keys are _sort_keys' packing of scores at pages j: (key(score) << 32) | (2^31 - 1 - j), unique, lanes in page
order; "threshold" relies on that order for ties (packed winners of an earlier stage would need four passes more).

python benchmarks/topk_proto.py [--rows 38,128] [--out results/topk_proto.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton
import triton.language as tl

METHODS = ("bitonic", "per-warp", "threshold")
N, K, WARPS = 1024, 64, 8


@triton.jit
def _threshold_topk(x, out_row, N: tl.constexpr, K: tl.constexpr):
    """The K largest of the unique keys x [N] (ties of the high word broken by lane, lower first), sorted
    descending; out_row [K] is scratch."""
    u = (x >> 32).to(tl.int32) ^ -2147483648  # the high word, signed order as unsigned
    u = u.to(tl.uint32, bitcast=True)
    bins = tl.arange(0, 256)
    need = K
    prefix = tl.zeros([], tl.uint32)
    for p in tl.static_range(4):
        shift = 24 - 8 * p
        if p == 0:
            match = u == u
        else:
            match = (u >> (shift + 8)) == prefix
        hist = tl.histogram(((u >> shift) & 0xFF).to(tl.int32), 256, mask=match)
        from_top = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist  # matched keys whose digit is >= the bin's
        d = tl.max(tl.where(from_top >= need, bins, -1), 0)
        need -= tl.sum(tl.where(bins > d, hist, 0), 0)
        prefix = (prefix << 8) | d.to(tl.uint32)
    eq = u == prefix
    take = (u > prefix) | (eq & (tl.cumsum(eq.to(tl.int32), 0) <= need))
    rank = tl.cumsum(take.to(tl.int32), 0) - 1
    tl.store(out_row + rank, x, mask=take)
    tl.debug_barrier()
    return tl.sort(tl.load(out_row + tl.arange(0, K)), descending=True)


@triton.jit
def _topk_kernel(x_ptr, out_ptr, N: tl.constexpr, K: tl.constexpr, METHOD: tl.constexpr, W: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x = tl.load(x_ptr + row * N + tl.arange(0, N))
    out_row = out_ptr + row * K
    if METHOD == 0:
        top = tl.topk(x, K)
    elif METHOD == 1:
        top = tl.topk(tl.reshape(tl.topk(tl.reshape(x, [W, N // W]), K), [W * K]), K)
    else:
        top = _threshold_topk(x, out_row, N, K)
    tl.debug_barrier()  # the threshold's scratch reads are done before the row is overwritten
    tl.store(out_row + tl.arange(0, K), top)


def packed_keys(rows: int, seed: int, device: str) -> torch.Tensor:
    """_sort_keys' packing of random scores, with ties and -inf, lanes in page order."""
    gen = torch.Generator().manual_seed(seed)
    f = torch.rand(rows, N, generator=gen)
    f[:, ::7] = f[:, :1]  # ties of the high word
    f[0, 900:] = float("-inf")
    bits = f.view(torch.int32).long()
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return ((key << 32) | (0x7FFFFFFF - torch.arange(N))).to(device)


def run(x: torch.Tensor, method: str) -> torch.Tensor:
    out = torch.full((x.shape[0], K), -1, dtype=torch.int64, device=x.device)
    _topk_kernel[(x.shape[0],)](x, out, N=N, K=K, METHOD=METHODS.index(method), W=WARPS, num_warps=WARPS)
    return out


def sass_counts(method: str) -> dict:
    sys.path.insert(0, str(Path(__file__).parent))
    from sass import compile_sass

    launch = dict(module=__name__ if __name__ != "__main__" else "topk_proto", name="_topk_kernel",
                  signature={"x_ptr": "*i64", "out_ptr": "*i64", "N": "constexpr", "K": "constexpr",
                             "METHOD": "constexpr", "W": "constexpr"},
                  constexprs=dict(N=N, K=K, METHOD=METHODS.index(method), W=WARPS), divisible=[0, 1],
                  options={"num_warps": WARPS})
    with tempfile.TemporaryDirectory() as tmp:
        res = compile_sass(launch, Path(tmp))
    return {"instructions": res["instructions"], "registers": res["registers"],
            **{op: res["opcodes"][op] for op in ("BAR", "SHFL", "LDS", "STS", "ATOMS")}}


def check(device: str) -> None:
    """Each method's top-k of a few rows equals torch.topk's, on the GPU or under TRITON_INTERPRET=1."""
    x = packed_keys(3, seed=0, device=device)
    want = torch.topk(x.cpu(), K).values
    for method in METHODS:
        assert torch.equal(run(x, method).cpu(), want), f"{method} differs from torch.topk"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="38,128", help="rows a launch (16 x 8 heads: 38 flagged at 0.3, 128 all)")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--out", default="results/topk_proto.json")
    ap.add_argument("--check", action="store_true", help=argparse.SUPPRESS)  # the interpreter's child process
    args = ap.parse_args()
    if args.check:
        check("cpu")
        return
    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    if cuda:
        check(dev)
    else:  # the kernels compile for sm_90 here, so the interpreter checks them in a child process
        env = dict(os.environ, TRITON_INTERPRET="1")
        subprocess.run([sys.executable, __file__, "--check"], env=env, check=True)
    results = []
    for method in METHODS:
        row = {"method": method, **sass_counts(method)}
        if cuda:
            from gpu_timing import graph_replay_ms

            for rows in map(int, args.rows.split(",")):
                xs = packed_keys(rows, seed=rows, device=dev)
                row[f"us_{rows}_rows"] = 1e3 * graph_replay_ms(lambda xs=xs: [run(xs, method) for _ in range(32)],
                                                               args.repeats) / 32
        results.append(row)
        print(" ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"gpu": torch.cuda.get_device_name() if cuda else None, "rows": results},
                                         indent=1))


if __name__ == "__main__":
    main()
