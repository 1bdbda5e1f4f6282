"""How many selected pages change per decode step on the real SmolLM2-135M (CPU): the delta that FreeKV recalls.

    python3 benchmarks/churn.py --text ../shared/papers/freekv-iclr.txt --context 3000 --new 64 \
        --out results/churn-smollm2.json

The prompt is the first --context tokens of a text file, then "In short, this paper" and greedy generation.
Two runs with the same prompt, of 2 and 2 + --new tokens. The difference of their recalled bytes is what the
steady-state steps recall, without the first selection's fill. This is given per step and per KV head of each
sparse layer, in pages and as a share of the budget's pages. On the GPU, one step of a batch of B requests recalls
about B x (that share) x the budget's KV bytes over PCIe (benchmarks/decode.py measures it in the server).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from freekv_sglang.config import FreeKVConfig
from freekv_sglang.hf_adapter import FreeKVModel
from freekv_sglang.hf_models import load_smollm2


def generate(model, cfg: FreeKVConfig, ids: list[int], new: int) -> tuple[FreeKVModel, list[int], dict, int]:
    """The model, its greedy tokens, the engine's stats and the bytes it recalled."""
    fm = FreeKVModel.build(model, cfg, max_requests=1, max_context=len(ids) + new + 16)
    out = fm.generate([ids], new)[0]
    st = fm.engine.stats()
    return fm, out, st, st["recall_bytes_now"] + st["recall_bytes_speculative"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--text", required=True, help="a natural-language text file; its first --context tokens prompt")
    ap.add_argument("--context", type=int, default=3000)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--sink", type=int, default=32)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--tau", type=float, default=0.9)
    ap.add_argument("--out", default="results/churn-smollm2.json")
    args = ap.parse_args()

    model, tok = load_smollm2(dtype=torch.float32)
    ids = tok(Path(args.text).read_text())["input_ids"][:args.context]
    if len(ids) < args.context:
        raise SystemExit(f"{args.text} has {len(ids)} tokens, fewer than --context {args.context}")
    ids += tok("\n\nIn short, this paper")["input_ids"]
    cfg = FreeKVConfig(budget=args.budget, sink=args.sink, window=args.window, page_size=args.page_size,
                       tau=args.tau, dense_layers=1)
    base = generate(model, cfg, ids, 2)[3]
    fm, out, st, total = generate(model, cfg, ids, 2 + args.new)

    shape = fm.engine.shape
    heads = (shape.num_layers - cfg.dense_layers) * shape.num_kv_heads
    pages = (total - base) / args.new / st["recall_page_bytes"] / heads
    budget_pages = args.budget // args.page_size
    rates, cosines = list(st["correction_rate"].values()), list(st["mean_cosine"].values())
    row = {"model": "SmolLM2-135M-Instruct", "prompt_tokens": len(ids), "new_tokens": args.new,
           "budget": args.budget, "sink": args.sink, "window": args.window, "page_size": args.page_size,
           "tau": args.tau, "pages_per_head_per_step": round(pages, 2), "budget_pages": budget_pages,
           "share_of_budget_per_step": round(pages / budget_pages, 3),
           "correction_rate": round(sum(rates) / len(rates), 3),
           "mean_adjacent_query_cosine": round(sum(cosines) / len(cosines), 3),
           "text": Path(args.text).name, "generated": tok.decode(out)}
    print("| prompt tokens | budget pages | pages recalled / head / step | share of budget | correction rate | "
          "mean adjacent-query cosine |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    print(f"| {len(ids)} | {budget_pages} | {row['pages_per_head_per_step']} | {row['share_of_budget_per_step']} | "
          f"{row['correction_rate']} | {row['mean_adjacent_query_cosine']} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(row, indent=1))


if __name__ == "__main__":
    main()
