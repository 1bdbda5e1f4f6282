"""How a real model's decode attention churns (CPU; SmolLM2-135M, or --model qwen2.5-coder-0.5b): the pages FreeKV
recalls per step, how often it corrects, and how concentrated attention is, per sparse layer, for each selection.
These are the statistics the structured keys of benchmarks/engine_decode.py (--keys structured,
benchmarks/realistic_churn.py) are fitted to.

    python3 benchmarks/churn.py --text ../shared/papers/freekv-iclr.txt --context 3000 --new 64 \
        --selections sketch,rerank,means --out results/churn-smollm2.json

The prompt is the first --context tokens of a text file, then "In short, this paper" and greedy generation. The first
--warm decode steps fill the selection slots and are not counted; over the next --new steps, per sparse layer (the
means over layers in the table, every layer in the JSON):
  correction rate   the share of KV-head checks below tau (selected and recalled before attention)
  changed share     pages recalled per step and KV head, over the budget's pages: the share of the selection that
                    changes per step (before attention and speculative), which is what delta recall moves
  cos mean / std    the group-mean cosine of adjacent queries per KV head, over (head, step)
  boundary          the share of steps whose mean cosine over all query heads is below 0.7 (LouisKV's boundary)
  top-k / top-1     attention mass of the k best pages (k = the budget's pages; also k / 2 and 2k) / of the best
                    page, over the candidate pages (exact keys); covered: the mass of the pages the selection attended
  oracle change     the share of the k best pages that were not the k best at the previous step
and, over every sparse layer, per bucket of the adjacent queries' cosine (a second table): the share of (KV head,
step) cases, their oracle change, the selection's changed share, and the share whose selection did not change, i.e.
what speculative reselection a head whose query barely turned would save by skipping.
On the GPU, one step of a batch of B requests recalls about B x (changed share) x the budget's KV bytes per sparse
layer over PCIe (benchmarks/decode.py measures it in the server).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from freekv_sglang.calibration import calibration_ids
from freekv_sglang.config import FreeKVConfig
from freekv_sglang.hf_adapter import FreeKVModel
from freekv_sglang.hf_models import MODELS, load_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
from realistic_churn import VICTIM_SIZES, ChurnProbe, counters, summarize  # noqa: E402

SOURCES = {"smollm2": "SmolLM2-135M", "qwen2.5-coder-0.5b": "Qwen2.5-Coder-0.5B"}
COLUMNS = ("correction_rate", "changed_share", "changed_share_now", "cos_mean", "cos_std", "boundary",
           "top_half_k_mass", "topk_mass", "top_2k_mass", "top1_mass", "covered_mass", "oracle_change",
           *(f"victim_hit_{f:g}" for f in VICTIM_SIZES))


def table(rows: list[dict]) -> str:
    lines = ["| source | selection | " + " | ".join(c.replace("_", " ") for c in COLUMNS) + " |",
             "| --- | --- |" + " ---: |" * len(COLUMNS)]
    for r in rows:
        lines.append(f"| {r['source']} | {r['selection']} | " + " | ".join(f"{r['mean'][c]:.3f}" for c in COLUMNS)
                     + " |")
    return "\n".join(lines)


def cos_table(rows: list[dict]) -> str:
    lines = ["| selection | cosine | share of cases | oracle change | changed share | unchanged |",
             "| --- | --- | ---: | ---: | ---: | ---: |"]
    for r in rows:
        for b in r["by_cos"]:
            close = ")" if b["cos_to"] < 1 else "]"  # a cosine of 1 falls in the last bucket
            lines.append(f"| {r['selection']} | [{b['cos_from']:g}, {b['cos_to']:g}{close} | {b['share']:.3f} | "
                         f"{b['oracle_change']:.3f} | {b['changed_share']:.3f} | {b['unchanged']:.3f} |")
    return "\n".join(lines)


def prompt_ids(tok, text: str, context: int) -> list[int]:
    """The first `context` tokens of a text file, then a cue to summarise it."""
    ids = tok(Path(text).read_text())["input_ids"][:context]
    if len(ids) < context:
        raise SystemExit(f"{text} has {len(ids)} tokens, fewer than --context {context}")
    return ids + tok("\n\nIn short, this paper")["input_ids"]


def probed_decode(model, tok, cfg: FreeKVConfig, ids: list[int], warm: int, new: int, make_probe):
    """One greedy decode of warm + new steps with make_probe(engine) as the engine's probe, active over the last
    new: (the FreeKVModel, the probe, counters() when it turned active, the tokens)."""
    fm = FreeKVModel.build(model, cfg, max_requests=1, max_context=len(ids) + warm + new + 16)
    if fm.needs_calibration:
        fm.calibrate(calibration_ids(tok))
    probe = fm.engine.probe = make_probe(fm.engine)
    cache = fm.prefill(ids)
    slot = fm.load_prefill(cache)
    out = [cache.first_token]
    for i in range(warm + new):
        if i == warm:
            probe.active, before = True, counters(fm.engine)
        out += fm.decode_step([slot], [out[-1]])
    return fm, probe, before, out


def run(model, tok, cfg: FreeKVConfig, ids: list[int], warm: int, new: int) -> tuple[dict, list[int]]:
    """One greedy decode of warm + new steps, measured over the last new."""
    fm, probe, before, out = probed_decode(model, tok, cfg, ids, warm, new, ChurnProbe)
    return summarize(probe, fm.engine, before, new, 1), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--text", required=True, help="a natural-language text file; its first --context tokens prompt")
    ap.add_argument("--context", type=int, default=3000)
    ap.add_argument("--new", type=int, default=64, help="measured decode steps")
    ap.add_argument("--warm", type=int, default=2, help="decode steps before them (the slots' first fill)")
    ap.add_argument("--selections", default="channels,sketch,rerank,means")
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--sink", type=int, default=32)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--tau", type=float, default=0.9)
    ap.add_argument("--hysteresis", default="0", help="comma-separated FreeKVConfig.hysteresis values, each a row")
    ap.add_argument("--model", default="smollm2", choices=sorted(MODELS), help="a packaged model (hf_models)")
    ap.add_argument("--out", default="results/churn-smollm2.json")
    args = ap.parse_args()

    model, tok = load_model(args.model, torch.float32)
    ids = prompt_ids(tok, args.text, args.context)
    rows = []
    for selection, hyst in [(s, float(h)) for s in args.selections.split(",") if s
                            for h in args.hysteresis.split(",") if h]:
        cfg = FreeKVConfig(budget=args.budget, sink=args.sink, window=args.window, page_size=args.page_size,
                           tau=args.tau, dense_layers=1, selection=selection, hysteresis=hyst)
        stats, out = run(model, tok, cfg, ids, args.warm, args.new)
        rows.append({"source": SOURCES.get(args.model, args.model),
                     "selection": selection if not hyst else f"{selection}/h{hyst:g}",
                     "hysteresis": hyst, "prompt_tokens": len(ids), "new_tokens": args.new,
                     "budget": args.budget, "sink": args.sink, "window": args.window, "page_size": args.page_size,
                     "tau": args.tau, "budget_pages": cfg.select_pages, "text": Path(args.text).name,
                     "generated": tok.decode(out), **stats})
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "per_layer"}), flush=True)
    print(table(rows))
    print(cos_table(rows))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"rows": rows}, indent=1))


if __name__ == "__main__":
    main()
