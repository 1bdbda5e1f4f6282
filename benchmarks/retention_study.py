"""Which pages should stay on the GPU between steps: retention policies replayed on a real model's decode attention
(CPU; SmolLM2-135M or --model qwen2.5-coder-0.5b).

The recall is what bounds a served step under a real model's churn (benchmarks/NOTES.md, sessions 22-26), and
benchmarks/churn.py finds that about half the pages a selection recalls left its attended set a few steps before
(victim_hit_F). So
with the same GPU pages per (request, layer, KV head), C = the budget's pages, does a policy that keeps recently
useful pages recall less for the same attention mass? One greedy decode with the default selection records, every
step and sparse layer, each KV head's exact attention mass over its candidate pages (the oracle's scores; the decode
path itself is FreeKV's). Then per (layer, head), from the same start, each policy holds C pages:
  top/hH      the C pages of most mass, a resident page's mass counted (1 + H) times (FreeKV's hysteresis)
  lru/kK      the K pages of most mass are always held; the other C - K places keep the pages most recently among
              those K (a page enters only through the top K and leaves when it is the least recently top-K one)
and reports per step the pages it brings in over C (what recall moves) and the mass it holds.

    python benchmarks/retention_study.py --text ../shared/papers/freekv-iclr.txt --context 7000 --new 64 \\
        --out results/retention-smollm2.json
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import torch

from freekv_sglang.config import FreeKVConfig
from freekv_sglang.hf_models import MODELS, load_model
from freekv_sglang.selectors import page_attention_mass

from churn import probed_decode, prompt_ids  # benchmarks/, the script's directory, is on sys.path


class MassRecorder:
    """engine.probe: each sparse layer's per-head attention mass over the candidate pages of row 0, every step."""

    def __init__(self, engine):
        self.e = engine
        self.active = False
        self.mass: dict[tuple[int, int], list[torch.Tensor]] = defaultdict(list)

    @torch.no_grad()
    def __call__(self, layer: int, plan, q: torch.Tensor, slots: torch.Tensor) -> None:
        e = self.e
        H, G, D = e.shape.num_kv_heads, e.shape.group, e.shape.head_dim
        end = min(int(plan.cand_end[0]), e.max_pages)
        if not self.active or end - e.cfg.sink_pages <= e.cfg.select_pages:
            return
        slot = int(plan.req_slots[0])
        mass = page_attention_mass(e, layer, slot, q[0].view(H, G, D).float().clone(), end)
        for h in range(H):
            self.mass[(layer, h)].append(mass[h].clone())


def top(masses: list[torch.Tensor], C: int, hysteresis: float) -> tuple[list[int], list[float]]:
    held: set[int] = set(masses[0].topk(C).indices.tolist())
    brought, covered = [], []
    for m in masses[1:]:
        score = m.clone()
        score[list(held)] *= 1.0 + hysteresis
        now = set(score.topk(min(C, len(m))).indices.tolist())
        brought.append(len(now - held))
        held = now
        covered.append(float(m[list(held)].sum()))
    return brought, covered


def lru(masses: list[torch.Tensor], C: int, K: int) -> tuple[list[int], list[float]]:
    order = masses[0].topk(C).indices.tolist()
    held = set(order)
    last = {p: 0 for p in order}  # step at which the page was last among the top K
    brought, covered = [], []
    for t, m in enumerate(masses[1:], start=1):
        best = m.topk(K).indices.tolist()
        for p in best:
            last[p] = t
        new = [p for p in best if p not in held]
        for p in new:
            if len(held) >= C:
                # The least recently top-K page not in this step's top K; ties: the lower mass now.
                victim = min((q for q in held if last.get(q, -1) < t), key=lambda q: (last.get(q, -1), float(m[q])))
                held.remove(victim)
            held.add(p)
        brought.append(len(new))
        covered.append(float(m[list(held)].sum()))
    return brought, covered


def study(mass: dict[tuple[int, int], list[torch.Tensor]], C: int, hysteresis: list[float],
          keep: list[int]) -> list[dict]:
    policies = [(f"top/h{h:g}", lambda ms, h=h: top(ms, C, h)) for h in hysteresis]
    policies += [(f"lru/k{k}", lambda ms, k=k: lru(ms, C, k)) for k in keep]
    rows = []
    for name, fn in policies:
        brought = covered = steps = 0
        for masses in mass.values():
            b, c = fn(masses)
            brought, covered, steps = brought + sum(b), covered + sum(c), steps + len(b)
        rows.append({"policy": name, "changed_share": brought / max(steps * C, 1),
                     "covered_mass": covered / max(steps, 1), "cases": steps})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--text", required=True, help="a natural-language text file; its first --context tokens prompt")
    ap.add_argument("--context", type=int, default=7000)
    ap.add_argument("--new", type=int, default=64, help="recorded decode steps")
    ap.add_argument("--warm", type=int, default=2)
    ap.add_argument("--budget", type=int, default=512, help="C = budget / page size pages per (layer, KV head)")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--sink", type=int, default=32)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--hysteresis", default="0,1,3")
    ap.add_argument("--keep", default=None, help="comma-separated K of the lru policies (default C/4, C/2, 3C/4)")
    ap.add_argument("--model", default="smollm2", choices=sorted(MODELS), help="a packaged model (hf_models)")
    ap.add_argument("--out", default="results/retention.json")
    args = ap.parse_args()

    model, tok = load_model(args.model, torch.float32)
    ids = prompt_ids(tok, args.text, args.context)
    cfg = FreeKVConfig(budget=args.budget, sink=args.sink, window=args.window, page_size=args.page_size,
                       dense_layers=1)
    C = cfg.select_pages
    keep = [int(k) for k in args.keep.split(",")] if args.keep else [C // 4, C // 2, 3 * C // 4]
    _, rec, _, out = probed_decode(model, tok, cfg, ids, args.warm, args.new, MassRecorder)
    rows = study(rec.mass, C, [float(h) for h in args.hysteresis.split(",")], keep)
    print(f"{args.model}, {len(ids)} prompt tokens, {args.new} steps, C = {C} pages of {args.page_size}, "
          f"{len(rec.mass)} (layer, KV head) cases; exact attention mass as the score")
    print("| policy | changed share per step | mass held |\n| --- | ---: | ---: |")
    for r in rows:
        print(f"| {r['policy']} | {r['changed_share']:.3f} | {r['covered_mass']:.3f} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "C": C, "prompt_tokens": len(ids),
                                          "generated": tok.decode(out), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
