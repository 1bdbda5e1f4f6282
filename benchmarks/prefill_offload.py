"""How much a prefill's offload to host memory slows the prefill itself, by how the offload is issued.

    python3 benchmarks/prefill_offload.py --out results/prefill-offload.json

A prefill chunk of T tokens through Llama-3.1-8B-shaped layers (the four GEMMs of a layer, bf16) on the main
stream; after each layer, that layer's T / p pages (8 KV heads, page 32, head dim 128) leave the staging buffer for
a pinned host arena [pages, layers, H, 2, p, D] on a side stream, as FreeKV's staged prefill does. Variants:
  none            the GEMMs alone: the baseline;
  sm-all          offload_pages with one program per (page, head), the kernel's default;
  sm-N            offload_pages with N programs striding over the (page, head) items;
  copy-engine     offload_pages packs the pages HND into a GPU scratch, then one cuMemcpy2DAsync per run of
                  consecutive host pages moves them on a copy engine (no SMs during the transfer).
Per variant: wall time of the chunk's layers with the offload joined at the end, its slowdown over `none`, and the
offload alone (no GEMMs) in GB/s beside the host->GPU copy peak of the same run.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
import time
from pathlib import Path

import torch
from freekv_kernels.offload import offload_pages

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode import copy_peak_gbps

HID, INTER, HQ, H, D, P = 4096, 14336, 32, 8, 128, 32
BF = torch.bfloat16


class _Memcpy2D(ctypes.Structure):
    _fields_ = [("srcXInBytes", ctypes.c_size_t), ("srcY", ctypes.c_size_t), ("srcMemoryType", ctypes.c_int),
                ("srcHost", ctypes.c_void_p), ("srcDevice", ctypes.c_uint64), ("srcArray", ctypes.c_void_p),
                ("srcPitch", ctypes.c_size_t), ("dstXInBytes", ctypes.c_size_t), ("dstY", ctypes.c_size_t),
                ("dstMemoryType", ctypes.c_int), ("dstHost", ctypes.c_void_p), ("dstDevice", ctypes.c_uint64),
                ("dstArray", ctypes.c_void_p), ("dstPitch", ctypes.c_size_t), ("WidthInBytes", ctypes.c_size_t),
                ("Height", ctypes.c_size_t)]


_CU = ctypes.CDLL("libcuda.so.1") if torch.cuda.is_available() else None


def memcpy2d_to_host(dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, height: int, stream) -> None:
    """Device -> pinned host rows on the stream's copy engine (driver API: torch has no strided D2H)."""
    m = _Memcpy2D(srcMemoryType=2, srcDevice=src, srcPitch=src_pitch, dstMemoryType=1, dstHost=dst,
                  dstPitch=dst_pitch, WidthInBytes=width, Height=height)
    rc = _CU.cuMemcpy2DAsync_v2(ctypes.byref(m), ctypes.c_void_p(stream.cuda_stream))
    if rc != 0:
        raise RuntimeError(f"cuMemcpy2DAsync failed: CUresult {rc}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192, help="prefill chunk")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--programs", default="4,8,16,32,64")
    ap.add_argument("--out", default="results/prefill-offload.json")
    args = ap.parse_args()
    T, L = args.tokens, args.layers
    n = T // P
    dev = torch.device("cuda")
    w = [torch.randn(a, b, device=dev, dtype=BF) * 0.01 for a, b in
         ((HID, (HQ + 2 * H) * D), (HQ * D, HID), (HID, 2 * INTER), (INTER, HID))]
    x = torch.randn(T, HID, device=dev, dtype=BF)
    k = torch.randn(L, T, H, D, device=dev, dtype=BF)
    v = torch.randn(L, T, H, D, device=dev, dtype=BF)
    arena = torch.empty(n, L, H, 2, P, D, dtype=BF).pin_memory()
    summ = torch.empty(L, n, H, 2, D, device=dev, dtype=BF)
    scratch = torch.empty(n, H, 2, P, D, device=dev, dtype=BF)
    src = torch.arange(n, dtype=torch.int32, device=dev)
    valid = torch.ones(n, dtype=torch.bool, device=dev)
    side = torch.cuda.Stream()
    page_bytes = H * 2 * P * D * 2

    def gemms():
        qkv = x @ w[0]
        o = qkv[:, :HQ * D] @ w[1]
        up = (x + o) @ w[2]
        return up[:, :INTER] @ w[3]

    def offload(variant: str, layer: int) -> None:
        if variant == "copy-engine":
            offload_pages(k[layer], v[layer], scratch, summ[layer], src, src, valid, P)
            memcpy2d_to_host(arena[:, layer].data_ptr(), arena.stride(0) * 2, scratch.data_ptr(), page_bytes,
                             page_bytes, n, side)
        else:
            progs = 0 if variant == "sm-all" else int(variant.split("-")[1])
            offload_pages(k[layer], v[layer], arena[:, layer], summ[layer], src, src, valid, P, programs=progs)

    def run(variant: str, with_gemms: bool = True) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for layer in range(L):
            if with_gemms:
                gemms()
            if variant != "none":
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    offload(variant, layer)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1e3

    def median(variant: str, with_gemms: bool = True, reps: int = 7) -> float:
        run(variant, with_gemms)
        return sorted(run(variant, with_gemms) for _ in range(reps))[reps // 2]

    peak = copy_peak_gbps()
    variants = ["none", "sm-all"] + [f"sm-{p}" for p in args.programs.split(",")] + ["copy-engine"]
    rows = []
    base = median("none")
    for var in variants:
        ms = median(var)
        alone = median(var, with_gemms=False) if var != "none" else 0.0
        gbps = L * n * page_bytes / 1e6 / alone if alone else None
        rows.append({"variant": var, "chunk_ms": round(ms, 3), "slowdown": round(ms / base - 1, 4),
                     "offload_alone_ms": round(alone, 3), "offload_gbps": gbps and round(gbps, 1),
                     "of_peak": gbps and round(gbps / peak, 3)})
        print(json.dumps(rows[-1]), flush=True)
    # The copy-engine path wrote the same bytes as the kernels: check it against the arena the last run left.
    offload_pages(k[L - 1], v[L - 1], scratch, summ[L - 1], src, src, valid, P)
    torch.cuda.synchronize()
    assert torch.equal(arena[:, L - 1], scratch.cpu()), "copy-engine offload wrote other bytes"
    out = {"gpu": torch.cuda.get_device_name(), "copy_peak_gbps": round(peak, 1), "tokens": T, "layers": L,
           "page_size": P, "kv_heads": H, "head_dim": D, "offload_mb_per_layer": round(n * page_bytes / 1e6, 1),
           "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"\n{out['gpu']}: {T}-token chunk x {L} layers, {out['offload_mb_per_layer']} MB offloaded per layer; "
          f"copy peak {peak:.1f} GB/s")
    print(f"{'variant':<12} {'chunk ms':>9} {'slowdown':>9} {'offload alone ms':>17} {'GB/s':>6} {'of peak':>8}")
    for r in rows:
        print(f"{r['variant']:<12} {r['chunk_ms']:>9.2f} {100 * r['slowdown']:>8.1f}% {r['offload_alone_ms']:>17.2f} "
              f"{r['offload_gbps'] or 0:>6.1f} {100 * (r['of_peak'] or 0):>7.0f}%")


if __name__ == "__main__":
    main()
