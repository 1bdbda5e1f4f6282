"""fp8_linear (an e4m3 copy of W, --kv-early-weights fp8) against bf16 x @ W^T (cuBLAS, the served default) alone, on
a GPU: N layers' weights in one CUDA graph (more bytes than L2 holds, as in a step), µs a call, and the HBM bytes'
rate each reaches against a device copy's peak measured in the same run. Sweeps fp8_linear's Tiles (the CUDA-core
path with every row of x in one program, and above one row the tensor-core dot). Prints a table and writes JSON.

python benchmarks/fp8_linear.py --rows 1,4,16 --n 4096 --k 4096 --layers 8 --out results/fp8_linear.json
"""

from __future__ import annotations

import argparse
import itertools
import json
from dataclasses import asdict, replace
from pathlib import Path

import torch
import triton
from freekv_kernels.fp8_linear.triton import TILES, Tiles, fp8_linear
from freekv_kernels.fp8_rows import naive_quantize_rows
from gpu_timing import graph_replay_ms
from split_attention import copy_peak_gbps


def sweep(rows: int, quick: bool) -> list[Tiles]:
    """The served tiles first, then around them (session 57's sweep found the neighbourhood): the CUDA-core path with
    every row in one program (a tile of 2K-16K fp32 products), and above one row the tensor-core dot."""
    if quick:
        return [TILES]
    bm = triton.next_power_of_2(rows)
    if rows == 1:
        grid = itertools.product((8, 16), (256, 512), (3, 4), (2, 4))
    else:
        grid = itertools.product((8, 16, 32), (32, 64, 128, 256, 512), (3, 4), (2, 4))
    tiles = [replace(TILES, gemv_rows=rows, gemv_bn=bn, gemv_bk=bk, gemv_stages=s, gemv_warps=w)
             for bn, bk, s, w in grid if 2048 <= bm * bn * bk <= 16384]
    if rows > 1:
        grid = itertools.product((32, 64), (256, 512), (3, 4), (4,))
        tiles += [replace(TILES, bn=bn, bk=bk, stages=s, warps=w) for bn, bk, s, w in grid if bn * bk <= 16384]
    return list(dict.fromkeys([TILES] + tiles))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,4,16", help="rows of x (requests in the early lane)")
    ap.add_argument("--n", type=int, default=4096, help="W's rows (q_size; Llama-3.1-8B 4096)")
    ap.add_argument("--k", type=int, default=4096, help="W's columns (hidden size)")
    ap.add_argument("--layers", type=int, default=8, help="distinct weights a graph (8 x 16 MB of e4m3 > L2)")
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--quick", action="store_true", help="the served tiles only")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.manual_seed(0)
    ws = [torch.randn(args.n, args.k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(args.layers)]
    w8 = [naive_quantize_rows(w) for w in ws]
    peak = copy_peak_gbps(args.repeats)
    us = lambda run: graph_replay_ms(run, args.repeats) * 1e3 / args.layers  # noqa: E731
    print(f"{torch.cuda.get_device_name()}; W [{args.n}, {args.k}], {args.layers} layers a graph; copy peak "
          f"{peak:.0f} GB/s; µs a call (GB/s of W's bytes)")
    results = dict(gpu=torch.cuda.get_device_name(), n=args.n, k=args.k, layers=args.layers, copy_peak_gbps=peak,
                   rows={})
    for m in (int(r) for r in args.rows.split(",")):
        x = torch.randn(m, args.k, device="cuda", dtype=torch.bfloat16)
        bf16 = us(lambda: [torch.nn.functional.linear(x, w) for w in ws])
        ref = torch.nn.functional.linear(x, ws[0]).float()
        floor_bf16, floor_fp8 = (args.n * args.k * b / peak / 1e3 for b in (2, 1))
        print(f"rows {m}: bf16 {bf16:.2f} µs ({2 * args.n * args.k / bf16 / 1e3:.0f}); floors at the copy peak: "
              f"bf16 {floor_bf16:.2f}, e4m3 {floor_fp8:.2f}")
        runs = []
        for t in sweep(m, args.quick):
            try:
                got = us(lambda: [fp8_linear(x, q, e, tiles=t) for q, e in w8])
            except Exception as err:  # noqa: BLE001 -- a tile too large for shared memory: skip it, say so
                print(f"  {t}: {type(err).__name__}")
                continue
            err = ((fp8_linear(x, *w8[0], tiles=t).float() - ref).norm() / ref.norm()).item()
            runs.append(dict(tiles=asdict(t), us=got, gbps=args.n * args.k / got / 1e3, rel_err=err))
        runs.sort(key=lambda r: r["us"])
        for r in runs[:8] + [r for r in runs[8:] if r["tiles"] == asdict(TILES)]:
            print(f"  {r['us']:7.2f} µs ({r['gbps']:5.0f})  err {r['rel_err']:.4f}  {r['tiles']}"
                  + ("  (served)" if r["tiles"] == asdict(TILES) else ""))
        results["rows"][m] = dict(bf16_us=bf16, floor_bf16_us=floor_bf16, floor_fp8_us=floor_fp8, fp8=runs)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
