"""The sparse layer's attention kernels alone, on a GPU: the served path of --kv-attention backend (head_token_index
then FlashInfer's decode over one-head rows) against --kv-attention split (attend_kept, attend_recalled), each
timed as a CUDA graph replay (median), at the Llama-3.1-8B shape (32 query heads over 8 KV heads, head dim 128,
bf16), page 32, budget 2048 (64 slots), sink 128, window 512. A share of the (row, KV head) pairs recalls a share
of its slots before attention; attend_kept reads the other pages (beside that recall in a served step), so what
follows the recall is attend_recalled alone. attend_pages (--kv-attention fused) is the pair in one launch with
nothing recalled; its error against FlashInfer's path is the row's pages_max_err. The HBM floor is the bytes of K and V read at the peak of a device
copy measured in the same run. Prints a table and writes JSON.

With --layers N, also each path as N calls in one graph over N cases of their own (N layers' KV, so nothing is served
from L2 that a step would read from HBM), timed with the host's launch hidden: µs a call as inside a served step,
without the graph launch that a single call's replay adds (~10 µs at one request).

python benchmarks/split_attention.py --batches 1,4,16 --out results/split_attention.json
python benchmarks/split_attention.py --batches 1,4,16 --layers 32 --out results/split_attention_layers.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import importlib

import torch
from freekv_kernels.split_attention import attend_kept, attend_pages, attend_recalled
from freekv_kernels.token_index import head_token_index
from gpu_timing import graph_replay_ms, time_ms

HQ, H, D, P, DTYPE = 32, 8, 128, 32, torch.bfloat16  # --shape qwen sets HQ, H = 28, 4
SINK, SLOTS, WINDOW = 4, 64, 17  # pages: 128 tokens, the 2048-token budget, 512 tokens and the page being filled
WIDTH = SINK + SLOTS + WINDOW
_WORKSPACE = None  # FlashInfer's float workspace, shared by every wrapper


def copy_peak_gbps(repeats: int) -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / (graph_replay_ms(lambda: dst.copy_(src), repeats) * 1e-3) / 1e9


def case(batch: int, flagged: float, changed: float, seed: int):
    gen = torch.Generator().manual_seed(seed)
    pages = batch * WIDTH + 1
    dev_gen = torch.Generator("cuda").manual_seed(seed)  # the caches on the device: --layers makes dozens
    k_cache = torch.randn(pages * P, H, D, generator=dev_gen, device="cuda").to(DTYPE)
    v_cache = torch.randn(pages * P, H, D, generator=dev_gen, device="cuda").to(DTYPE)
    q = torch.randn(batch, HQ, D, generator=gen).to(DTYPE).cuda()
    row_table = (1 + torch.arange(batch * WIDTH, dtype=torch.int32).view(batch, WIDTH)).cuda()
    full = lambda v: torch.full((batch,), v, dtype=torch.int32, device="cuda")  # noqa: E731
    slot_pages = row_table[:, SINK:SINK + SLOTS].contiguous()
    recall = torch.zeros(batch, H, SLOTS, dtype=torch.int8)
    heads = torch.rand(batch, H, generator=gen) < flagged
    recall[heads] = (torch.rand(int(heads.sum()), SLOTS, generator=gen) < changed).to(torch.int8)
    tokens = WIDTH * P  # every page full
    slots = torch.arange(SLOTS, dtype=torch.int32).repeat(batch, H, 1).cuda()  # logical page of each slot
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, row_table=row_table, row_pages=full(WIDTH),
                last_page_len=full(P), n_sink=full(SINK), n_slots=full(SLOTS), slot_pages=slot_pages,
                recall=recall.cuda(), slots=slots, req_slots=torch.arange(batch, dtype=torch.int32, device="cuda"),
                row_tokens=full(tokens), row_start=torch.arange(0, batch * tokens, tokens, dtype=torch.int32,
                                                                 device="cuda"), tokens=tokens)


def flashinfer_path(c: dict, batch: int, split: int = 0, part: str = "both"):
    """head_token_index then FlashInfer's decode, planned as FreeKV's FlashInfer path plans (tensor cores at G 4).
    split > 0: FlashInfer's fixed_split_size (tokens a chunk of a row), -1: no split, 0: its own choice (as served).
    part "lists" or "decode": that half alone."""
    import flashinfer

    n, tokens = batch * H, c["tokens"]
    indices = torch.empty(n * tokens, dtype=torch.int32, device="cuda")
    indptr = torch.arange(0, (n + 1) * tokens, tokens, dtype=torch.int32)
    global _WORKSPACE
    if _WORKSPACE is None:  # 512 MB: small fixed splits at 16 rows need ~360 MB of FlashInfer's temporaries
        _WORKSPACE = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
    # one float workspace for every wrapper, as the served wrappers share it: their kernels run one after another
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(_WORKSPACE, "NHD", use_tensor_cores=True)
    head_token_index(c["slots"], c["req_slots"], c["row_table"], c["n_sink"], c["n_slots"], c["slot_pages"],
                     c["row_tokens"], c["row_start"], P, indices)
    wrapper.plan(indptr, indices, torch.ones(n, dtype=torch.int32), HQ // H, 1, D, 1, data_type=DTYPE,
                 q_data_type=DTYPE, fixed_split_size=split if split > 0 else None, disable_split_kv=split < 0)
    kv = (c["k_cache"].view(-1, 1, 1, D), c["v_cache"].view(-1, 1, 1, D))

    def run():
        if part != "decode":
            head_token_index(c["slots"], c["req_slots"], c["row_table"], c["n_sink"], c["n_slots"],
                             c["slot_pages"], c["row_tokens"], c["row_start"], P, indices)
        if part != "lists":
            return wrapper.forward(c["q"].view(n, HQ // H, D), kv, sm_scale=D ** -0.5).view(batch, HQ, D)
    return run


def layers_us(runs: list, repeats: int) -> float:
    """µs a call of the calls `runs` (one per layer) captured back to back in one graph, the host's launch hidden."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for run in runs:
            run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for run in runs:
            run()
    return 1e3 * time_ms(lambda i: graph.replay(), repeats, warmup=3, hide_launch=True) / len(runs)


def layer_paths(batch: int, layers: int, scale: float, pages_splits: list[int]) -> dict[str, list]:
    """Each path's call for `layers` cases of its own (no recall before attention, as under previous_mlp_only);
    attend_pages with its own split count and at each of pages_splits."""
    paths: dict[str, list] = {"flashinfer": [], "lists": [], "fi_decode": [], "split": [], "kept": [], "pages": []}
    paths.update({f"pages_s{n}": [] for n in pages_splits})
    tickets = torch.zeros(batch * H, dtype=torch.int32, device="cuda")  # the layers' launches run one after another
    for i in range(layers):
        c = case(batch, 0.0, 0.0, seed=1000 * batch + i)
        kept_args = (c["q"], c["k_cache"], c["v_cache"], c["row_table"], c["row_pages"], c["last_page_len"],
                     c["n_sink"], c["n_slots"], c["recall"], 1, scale, P)
        paths["flashinfer"].append(flashinfer_path(c, batch))
        paths["lists"].append(flashinfer_path(c, batch, part="lists"))
        paths["fi_decode"].append(flashinfer_path(c, batch, part="decode"))
        paths["kept"].append(lambda a=kept_args: attend_kept(*a))
        paths["split"].append(lambda a=kept_args, c=c: attend_recalled(
            c["q"], c["k_cache"], c["v_cache"], c["slot_pages"], c["n_slots"], c["recall"], 1, scale, P,
            attend_kept(*a)))
        for n in [None] + pages_splits:
            paths["pages" if n is None else f"pages_s{n}"].append(lambda c=c, n=n: attend_pages(
                c["q"], c["k_cache"], c["v_cache"], c["row_table"], c["row_pages"], c["last_page_len"], scale, P,
                tickets, n))
    return paths


def pages_at_once(n: int):
    """attend_pages loading n pages at once (its module's setting) while the calls are captured."""
    kernel = importlib.import_module("freekv_kernels.split_attention.triton")
    kernel._PAGES_AT_ONCE = n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=("llama", "qwen"), default="llama",
                    help="Llama-3.1-8B's attention (32 query / 8 KV heads) or Qwen2.5-7B's (28 / 4)")
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--flagged", type=float, default=0.3, help="share of (row, KV head) pairs that recall")
    ap.add_argument("--changed", type=float, default=0.15, help="share of a recalling pair's slots it recalls")
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--recalled-shapes", default="",
                    help="also time attend_recalled with other (tokens per iteration x warps), e.g. 32x4,128x8")
    ap.add_argument("--splits", default="",
                    help="also FlashInfer's path with these fixed split sizes (tokens; -1: no split), its token "
                         "lists and its decode alone (served split), e.g. 128,256,512,-1")
    ap.add_argument("--layers", type=int, default=0,
                    help="also each path as this many calls in one graph over as many cases (µs a call, launch hidden)")
    ap.add_argument("--pages-splits", default="",
                    help="with --layers, also attend_pages at these split counts (programs a row and KV head)")
    ap.add_argument("--pages-at-once", default="",
                    help="with --layers, also attend_pages loading these numbers of pages at once")
    ap.add_argument("--out", default="results/split_attention.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/split_attention.py needs a CUDA device")
    global HQ, H
    HQ, H = (28, 4) if args.shape == "qwen" else (32, 8)
    peak = copy_peak_gbps(args.repeats)
    scale = D ** -0.5
    rows = []
    print(f"{torch.cuda.get_device_name()}  {args.shape}: {HQ} / {H} heads  copy peak {peak:.0f} GB/s  "
          f"flagged {args.flagged}  changed {args.changed}")
    print(f"{'batch':>5} {'KV MB':>7} {'floor us':>8} {'flashinfer':>10} {'kept':>7} {'recalled':>8} "
          f"{'split':>7} {'max err':>8}")
    for batch in map(int, args.batches.split(",")):
        c = case(batch, args.flagged, args.changed, seed=batch)
        kept_args = (c["q"], c["k_cache"], c["v_cache"], c["row_table"], c["row_pages"], c["last_page_len"],
                     c["n_sink"], c["n_slots"], c["recall"], 1, scale, P)
        parts = attend_kept(*kept_args)
        recalled = lambda parts: attend_recalled(c["q"], c["k_cache"], c["v_cache"], c["slot_pages"],  # noqa: E731
                                                 c["n_slots"], c["recall"], 1, scale, P, parts)
        fi = flashinfer_path(c, batch)
        err = (fi().float() - recalled(parts).float()).abs().max().item()
        tickets = torch.zeros(batch * H, dtype=torch.int32, device="cuda")
        pages_err = (fi().float() - attend_pages(c["q"], c["k_cache"], c["v_cache"], c["row_table"], c["row_pages"],
                                                 c["last_page_len"], scale, P, tickets).float()).abs().max().item()
        kv_bytes = batch * H * WIDTH * P * D * 2 * DTYPE.itemsize
        row = dict(batch=batch, kv_mb=kv_bytes / 1e6, floor_us=kv_bytes / peak / 1e3,
                   flashinfer_us=1e3 * graph_replay_ms(fi, args.repeats),
                   kept_us=1e3 * graph_replay_ms(lambda: attend_kept(*kept_args), args.repeats),
                   recalled_us=1e3 * graph_replay_ms(lambda: recalled(parts), args.repeats),
                   split_us=1e3 * graph_replay_ms(lambda: recalled(attend_kept(*kept_args)), args.repeats), max_err=err,
                   pages_max_err=pages_err)
        kernel = importlib.import_module("freekv_kernels.split_attention.triton")
        for shape in filter(None, args.recalled_shapes.split(",")):
            kernel._RECALLED_BLOCK, kernel._RECALLED_WARPS = map(int, shape.split("x"))
            row[f"recalled_us_{shape}"] = 1e3 * graph_replay_ms(lambda: recalled(parts), args.repeats)
            print(f"      attend_recalled {shape}: {row[f'recalled_us_{shape}']:.1f} us")
        kernel._RECALLED_BLOCK, kernel._RECALLED_WARPS = 64, 4
        if args.splits:
            for part in ("lists", "decode"):
                row[f"flashinfer_{part}_us"] = 1e3 * graph_replay_ms(flashinfer_path(c, batch, part=part),
                                                                     args.repeats)
            for split in map(int, args.splits.split(",")):
                run = flashinfer_path(c, batch, split)
                row[f"flashinfer_us_split_{split}"] = 1e3 * graph_replay_ms(run, args.repeats)
                row[f"max_err_split_{split}"] = (run().float() - fi().float()).abs().max().item()
            print("      flashinfer: lists {:.1f} us, decode {:.1f} us; by split: {}".format(
                row["flashinfer_lists_us"], row["flashinfer_decode_us"],
                ", ".join(f"{k.rsplit('_', 1)[1]} {v:.1f}" for k, v in row.items() if "us_split" in k)))
        if args.layers:
            splits = [int(n) for n in filter(None, args.pages_splits.split(","))]
            served = importlib.import_module("freekv_kernels.split_attention.triton")._PAGES_AT_ONCE
            paths = layer_paths(batch, args.layers, scale, splits)
            for name, runs in paths.items():
                row[f"layers_{name}_us"] = layers_us(runs, args.repeats)
            for n in (int(x) for x in filter(None, args.pages_at_once.split(","))):
                pages_at_once(n)  # read at each call: the same calls, captured again, launch the other variant
                for name, runs in paths.items():
                    if name.startswith("pages"):
                        row[f"layers_{name}_a{n}_us"] = layers_us(runs, args.repeats)
                pages_at_once(served)
            print(f"      {args.layers} layers in one graph, us a call: " + ", ".join(
                f"{k[7:-3]} {v:.1f}" for k, v in row.items() if k.startswith("layers_")))
            torch.cuda.empty_cache()
        rows.append(row)
        print(f"{batch:>5} {row['kv_mb']:>7.1f} {row['floor_us']:>8.1f} {row['flashinfer_us']:>10.1f} "
              f"{row['kept_us']:>7.1f} {row['recalled_us']:>8.1f} {row['split_us']:>7.1f} {err:>8.4f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "copy_peak_gbps": peak, "args": vars(args),
                               "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
