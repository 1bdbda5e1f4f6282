"""select_chain alone on a GPU, stage by stage: where a served layer's selection time goes. At the Llama-3.1-8B
attention shape (8 KV heads, groups of 4; --shape qwen: Qwen2.5-7B's, 4 KV heads, groups of 7), 32K context (1,000
candidate pages of 32 tokens), budget 2048 (64 slots),
one call per layer timed as the replay of a CUDA graph of 32 calls (a step's sparse layers), per call:

  select       select_slots over given page scores (no hysteresis, no victim cache)
  +hyst        with the default hysteresis (resident pages' scores boosted first)
  +victims     and the victim cache (--victims: entries a head; 64 is --kv-victim 2048, one budget)
  +pool        scores pooled from the channel sketch's per-page log-sum-exps first: the served chain
  +replay      and the realistic benchmark's churn replay (benchmarks only)
  +after       and what follows the selection before attention under --kv-attention backend: recall_pages of the
               changed slots (FP8 host pages, their victim moves) and head_token_index (the token lists and query
               rows), two more launches (session 48 measured them inside select_chain's launch: 5-11 µs slower)

for the heads that select before attention (a share --flagged of them, PHASE_NOW) and for every head (the
speculative phase). The slots start full. Only the replay changes them from call to call (its draws differ per call
of the 32, as the engine's differ per step), as in decode.py's realistic configs; without it the selection settles
after the first call, so the earlier columns are the stages' costs when nothing changes. Prints a table and writes JSON.

--pages sets the candidate pages (3750: 120K; past 1,024 select_chain takes the staged launches); --warps the one-stage
top-k's warps (page_select's TOPK_SINGLE_WARPS); each a comma-separated sweep.

python benchmarks/select_chain.py --batches 1,16 --out results/select_chain.json
python benchmarks/select_chain.py --pages 1000,3750 --warps 8,16,32 --stages +pool,+replay
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from freekv_kernels.page_select import PHASE_LATER, PHASE_NOW, select_slots
from freekv_kernels.page_select import triton as page_select_triton
from freekv_kernels.recall import recall_pages
from freekv_kernels.select_chain import LsePool, Replay, select_chain
from freekv_kernels.token_index import head_token_index
from gpu_timing import graph_replay_ms
from host_arena import HostLayer

SHAPES = {"llama": (8, 4), "qwen": (4, 7)}  # KV heads, group: Llama-3.1-8B's and Qwen2.5-7B's attention
K = 64
HYSTERESIS = 1.0  # freekv_sglang.config.DEFAULT_HYSTERESIS
STAGES = ("select", "+hyst", "+victims", "+pool", "+replay", "+after")
SINK, WINDOW = 4, 16  # pages: the served --kv-sink 128 and --kv-window 512 at page 32


def case(batch: int, pages: int, flagged: float, seed: int, shape: str = "llama", dev: str = "cuda") -> dict:
    H, G = SHAPES[shape]
    gen = torch.Generator().manual_seed(seed)
    lse = torch.randn(batch, H, pages, 1 << (G - 1).bit_length(), generator=gen).to(dev)
    resident = torch.stack([torch.randperm(pages, generator=gen)[:K] for _ in range(batch * H)]).view(batch, H, K)
    now = torch.rand(batch, H, generator=gen) < flagged
    return dict(lse=lse, scores=torch.rand(batch, H, pages, generator=gen).to(dev), resident=resident.int().to(dev),
                now=now.to(dev), req_slots=torch.arange(batch, dtype=torch.int32, device=dev),
                cand_end=torch.full((batch,), pages, dtype=torch.int32, device=dev),
                draws=torch.rand(32, batch, H, generator=gen).to(dev), group=G)


def chain(c: dict, stage: str, phase: int, churn: float, returns: float, entries: int):
    """One layer's selection as the engine calls it, up to `stage`, on state of its own."""
    batch, H = c["lse"].shape[:2]
    upto, dev = STAGES.index(stage), c["lse"].device
    slots = c["resident"].clone()
    recall = torch.zeros(batch, H, K, dtype=torch.int8, device=dev)
    victims = torch.full((batch, H, entries), -1, dtype=torch.int32, device=dev) if upto >= 2 else None
    age = torch.full_like(victims, -1) if victims is not None else None
    ops = torch.zeros(batch, H, K, dtype=torch.int32, device=dev) if victims is not None else None
    hyst = HYSTERESIS if upto >= 1 else 0.0
    heads = c["now"]

    recall_args, lists = after_args(c, entries) if upto >= 5 else (None, None)

    def run(i: int):
        replay = Replay(c["draws"][i], churn, returns) if upto >= 4 else None
        scores = LsePool(c["lse"], 0, c["cand_end"], c["group"], c["lse"].shape[2]) if upto >= 3 else c["scores"]
        if upto == 0:
            return select_slots(scores, slots, c["req_slots"], heads, phase, heads, recall)
        select_chain(scores, slots, c["req_slots"], heads, phase, heads, recall, hysteresis=hyst, victims=victims,
                     victim_age=age, victim_ops=ops, replay=replay)
        if upto == 5:
            a = recall_args
            recall_pages(a["host"], a["k_cache"], a["v_cache"], a["page_table"], slots, c["req_slots"],
                         a["slot_pages"], recall, phase, a["page_size"], victim_ops=ops, victim_base=a["victim_base"],
                         victim_entries=entries, host_scales=a["scales"])
            head_token_index(slots, c["req_slots"], *lists)
    run.state = dict(slots=slots, recall=recall, victim_ops=ops)  # what a recall after it reads (side_lanes.py)
    return run


def after_args(c: dict, entries: int) -> tuple[dict, tuple]:
    """What the recall and the token lists take beside the selection's state, as served: an FP8 arena in kvstore's
    layout behind random page tables, the GPU caches (slot pages, then the victim entries), the lists of sink, slots
    and window pages and the rows' queries: recall_pages' arguments by name, head_token_index's after its first two."""
    batch, H, pages = c["lse"].shape[:3]
    G, dev, p, D = c["group"], c["lse"].device, 32, 128
    host_pages = 4096
    arena = HostLayer(host_pages, "float8_e4m3fn", H, p, D)
    host, scales = arena.layer, arena.scales
    page_table = torch.randint(0, host_pages, (batch, pages), dtype=torch.int32, device=dev)
    k_cache, v_cache = torch.zeros(2, (batch * K + batch * entries) * p, H, D, dtype=torch.bfloat16, device=dev)
    slot_pages = torch.arange(batch * K, dtype=torch.int32, device=dev).view(batch, K)
    W = SINK + K + WINDOW
    tokens = torch.full((batch,), W * p, dtype=torch.int32, device=dev)
    recall_args = dict(host=host, k_cache=k_cache, v_cache=v_cache, page_table=page_table, slot_pages=slot_pages,
                       page_size=p, victim_base=batch * K, scales=scales)
    lists = (torch.randint(0, batch * K, (batch, W), dtype=torch.int32, device=dev),
             torch.full((batch,), SINK, dtype=torch.int32, device=dev),
             torch.full((batch,), K, dtype=torch.int32, device=dev), slot_pages, tokens,
             torch.cumsum(tokens, 0, dtype=torch.int32) - tokens, p,
             torch.empty(batch * W * p * H, dtype=torch.int32, device=dev),
             torch.randn(batch, H * G, D, dtype=torch.bfloat16, device=dev),
             torch.empty(batch * H, G, D, dtype=torch.bfloat16, device=dev))
    return recall_args, lists


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=SHAPES, default="llama")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--flagged", type=float, default=0.3, help="share of (row, KV head) pairs selecting before attn")
    ap.add_argument("--churn", type=float, default=0.15, help="the replay's changed share of the budget")
    ap.add_argument("--returns", type=float, default=0.5, help="the replay's share of the churn from the victim cache")
    ap.add_argument("--victims", default="64",
                    help="victim entries a head, comma-separated (64, 128, 256: one, two, four budgets)")
    ap.add_argument("--pages", default="1000", help="candidate pages a row, comma-separated")
    ap.add_argument("--warps", default="", help="the one-stage top-k's warps, comma-separated (default: as served)")
    ap.add_argument("--stages", default=",".join(STAGES), help="stages to time, comma-separated")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--out", default="results/select_chain.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/select_chain.py needs a CUDA device")
    stages = args.stages.split(",")
    assert set(stages) <= set(STAGES), f"stages are {STAGES}"
    H, G = SHAPES[args.shape]
    print(f"{torch.cuda.get_device_name()}: select_chain per call (graph of 32), {H} KV heads x group {G}, "
          f"{K} slots, flagged {args.flagged}, churn {args.churn}, returns {args.returns}")
    print(f"{'pages':>5} {'warps':>5} {'V':>4} {'batch':>5} {'phase':>12} "
          + " ".join(f"{s:>9}" for s in stages))
    rows = []
    ints = lambda text: [int(x) for x in text.split(",") if x]  # noqa: E731
    cells = [(p, w, v, b) for p in ints(args.pages) for w in ints(args.warps) or [0] for v in ints(args.victims)
             for b in ints(args.batches)]
    saved = page_select_triton.TOPK_SINGLE_WARPS
    for pages, warps, entries, batch in cells:
        if warps:
            page_select_triton.TOPK_SINGLE_WARPS = warps
        c = case(batch, pages, args.flagged, seed=batch, shape=args.shape)
        # PHASE_LATER selects the heads not flagged; flag none so that every head selects, as in the speculation.
        for phase, name in ((PHASE_NOW, "before attn"), (PHASE_LATER, "speculative")):
            if phase == PHASE_LATER:
                c = dict(c, now=torch.zeros_like(c["now"]))
            row = dict(shape=args.shape, pages=pages, warps=warps, victims=entries, batch=batch, phase=name)
            for stage in stages:
                run = chain(c, stage, phase, args.churn, args.returns, entries)
                row[stage] = 1e3 * graph_replay_ms(lambda: [run(i) for i in range(32)], args.repeats) / 32
            rows.append(row)
            print(f"{pages:>5} {warps or '-':>5} {entries:>4} {batch:>5} {name:>12} "
                  + " ".join(f"{row[s]:>9.1f}" for s in stages))
        page_select_triton.TOPK_SINGLE_WARPS = saved
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "args": vars(args), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
