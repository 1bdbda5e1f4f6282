"""How much the speculative lanes' kernels slow the critical lane's on a GPU, and whether confining the lanes to a
green context (a stream that runs on N of the GPU's SMs only) hides them better.

Session 53's trace of the 16 x 32K step (Llama-3.1-8B shape, `--kv-correct-at previous_mlp_only`): with nothing of
the correction left before attention, attention took 88 µs a layer against 58 alone and the MLP's GEMMs ~10 µs more
than alone, beside the previous layer's speculative scoring (~120 µs, started just before attention), its
select_chain (128 programs of ~15-45 µs) and its recall. A GEMM's CTA at 16 rows likely needs most of an SM, so
any side CTA resident on an SM keeps that SM from the critical kernel until it retires; a green context packs the
side CTAs onto N SMs and leaves the others to the critical lane (the primary context's kernels still use every SM).
Session 54 (H200, 16 rows, 8 layers, docs/results/session54): it does not. The lanes cost the critical lane 0.89 ms
on every SM and 1.44-3.42 ms on 48-16 SMs: confined, they run 1.5-3x longer, and a critical kernel still waits for
the SMs they hold. Alone beside the critical lane, the scoring cost 0.25 ms (72% of its own 0.35), select_chain 0.19
(more than its own 0.11) and the recall 0.36 (a third of its 1.12): each side CTA's SM time adds to the step.

Per layer, at the Llama-3.1-8B shape and --batch rows:
  critical  the QKV, output, gate/up and down projections (bf16 GEMMs, weights of --layers distinct layers so that
            they stream from HBM) and attention over the budget (SDPA, group rows as queries, sink + slots + window =
            2,688 tokens a (row, KV head); or with --attention the served paths over FreeKV's paged layout), on a
            stream at the critical priority (-1), as FreeKV's decode graph;
  side      the speculative lane (forked at each layer's start; served, its scoring starts just before attention):
            the channel sketch's scoring of every head over --pages candidate pages, select_chain with the
            realistic replay (PHASE_LATER), and the recall of its changed slots from an FP8 host arena with
            --recall-programs programs (--lanes picks a subset), on a stream at priority 0, or on a green-context
            stream of N SMs for each N in --sms;
  both      each layer's side lane forked beside its critical kernels, joined at the end;
  early     with --early SHARE: the next layer's correction one layer early (the predicted query's projection, the
            flagged heads' scoring, select_chain and one-program-a-slot recall) forked at each MLP's start on a
            stream at EARLY_PRIORITY, which the next attention waits for; timed with the critical lane alone (the
            line after the critical lane's) and with both (`all 3`, its `excess` over critical + early).
Each is timed as a CUDA graph's replay (eager runs would time the host's ~100 launches), in ms for --layers layers.
`excess` (both - critical) is what the side lane costs the critical lane; `side` alone grows as N shrinks, so compare
`excess` and `both` across rows. `sms` is how many SMs a probe launched on the side stream touched (smid_probe, eager
and captured), which must not exceed N. Prints a table and writes JSON.

python benchmarks/side_lanes.py --sms 0,16,24,32,48 --early 0.3 --out results/side_lanes.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import freekv_kernels.channel_sketch.triton as sketch_kernels
import freekv_kernels.page_select.triton as select_kernels
import freekv_kernels.recall.triton as recall_kernels
import select_chain as chain_bench
import sketch_lse
import split_attention
import torch
import torch.nn.functional as F
from freekv_kernels.page_select import PHASE_LATER, PHASE_NOW
from freekv_kernels.fp8_linear import fp8_linear
from freekv_kernels.fp8_rows import naive_quantize_rows
from freekv_kernels.recall import recall_pages
from freekv_kernels.split_attention import attend_pages
from freekv_kernels.testing import smid_probe, sms_touched
from freekv_sglang.streams import CRITICAL_PRIORITY, EARLY_PRIORITY
from gpu_timing import time_ms
from green_contexts import green_streams

# --warps LANE=N: the served launch's warps, as the module constant each launcher reads at every call
WARPS = {"score": (sketch_kernels, "CHANNEL_WARPS"), "chain": (select_kernels, "TOPK_SINGLE_WARPS"),
         "recall": (recall_kernels, "RECALL_WARPS")}
HIDDEN, QKV, INTER = 4096, 6144, 14336  # Llama-3.1-8B
KV_HEADS, GROUP, D = 8, 4, 128
BUDGET_TOKENS = 2688  # sink 128 + 64 slots of 32 + window 512
LANES = ("score", "chain", "recall")


class Critical:
    """The critical lane's kernels of --layers distinct layers. Attention (--attention): SDPA over the budget as one
    dense block a (row, KV head); or the served paths over FreeKV's paged layout (split_attention.py's cases): the
    token lists and FlashInfer's decode (--kv-attention backend), or attend_pages (--kv-attention fused) with
    `pages_splits` programs a (row, KV head) (None: its own choice)."""

    def __init__(self, batch: int, layers: int, attention: str = "sdpa", pages_splits: int | None = None,
                 dev: str = "cuda"):
        w = lambda *s: torch.randn(*s, device=dev, dtype=torch.bfloat16) * 0.02  # noqa: E731
        self.x = w(batch, HIDDEN)
        self.wqkv = [w(HIDDEN, QKV) for _ in range(layers)]
        self.wo = [w(HIDDEN, HIDDEN) for _ in range(layers)]
        self.wgu = [w(HIDDEN, 2 * INTER) for _ in range(layers)]
        self.wd = [w(INTER, HIDDEN) for _ in range(layers)]
        if attention == "sdpa":
            q = w(batch * KV_HEADS, 1, GROUP, D)
            kv = [w(2, batch * KV_HEADS, 1, BUDGET_TOKENS, D) for _ in range(layers)]
            self.attend = [lambda kv=kv[i]: F.scaled_dot_product_attention(q, kv[0], kv[1]) for i in range(layers)]
        else:
            cases = [split_attention.case(batch, 0.0, 0.0, seed=1000 * batch + i) for i in range(layers)]
            if attention == "flashinfer":
                self.attend = [split_attention.flashinfer_path(c, batch) for c in cases]
            else:
                tickets = torch.zeros(batch * KV_HEADS, dtype=torch.int32, device=dev)
                self.attend = [lambda c=c: attend_pages(c["q"], c["k_cache"], c["v_cache"], c["row_table"],
                                                        c["row_pages"], c["last_page_len"], D ** -0.5,
                                                        split_attention.P, tickets, pages_splits) for c in cases]

    def qkv(self, i: int) -> None:
        self.x @ self.wqkv[i]

    def attention(self, i: int) -> None:
        self.attend[i]()
        self.x @ self.wo[i]

    def mlp(self, i: int) -> None:
        gu = self.x @ self.wgu[i]
        (F.silu(gu[:, :INTER]) * gu[:, INTER:]) @ self.wd[i]


class CopyRecall:
    """The speculative recall's GPU side if the host gathered the changed pages into one pinned run first (not timed
    here): one copy-engine transfer of the host pages (FP8, K and V of a head's page, 8 KB), their conversion to bf16
    and scatter into the NHD cache (without the served path's per-row scales: the same bytes), and the victim hits'
    device-to-device moves, as torch ops. `host` and `victim` pages a layer: the replay's expected counts (rows x
    heads x slots x churn, split by `returns`)."""

    def __init__(self, batch: int, host: int, victim: int, dev: str = "cuda"):
        p, slots = 32, 64
        gen = torch.Generator().manual_seed(host)
        self.host_run = torch.randint(0, 120, (host, 2, p, D), dtype=torch.uint8, generator=gen).pin_memory()
        self.staged = torch.empty_like(self.host_run, device=dev)
        pages = batch * slots + victim
        self.k, self.v = torch.zeros(2, pages, p, KV_HEADS, D, dtype=torch.bfloat16, device=dev)
        pick = lambda n: (torch.randint(0, batch * slots, (n,), generator=gen).to(dev),  # noqa: E731
                          torch.randint(0, KV_HEADS, (n,), generator=gen).to(dev))
        self.host_dst, self.victim_dst = pick(host), pick(victim)
        self.victim_src = (batch * slots + torch.randint(0, max(victim, 1), (victim,), generator=gen)).to(dev)

    def layer(self, scatter: bool = True) -> None:
        self.staged.copy_(self.host_run, non_blocking=True)
        if not scatter:
            return
        kv = self.staged.view(torch.float8_e4m3fn).to(torch.bfloat16)  # [n, 2, p, D]
        page, head = self.host_dst
        self.k[page, :, head] = kv[:, 0]
        self.v[page, :, head] = kv[:, 1]
        page, head = self.victim_dst
        self.k[page, :, head] = self.k[self.victim_src, :, head]
        self.v[page, :, head] = self.v[self.victim_src, :, head]


class Lane:
    """One layer's selection lane on state of its own (each call replays fresh churn): with phase PHASE_LATER the
    speculative lane (every head scored, select_chain after attention, the recall capped at `recall_programs`), with
    PHASE_NOW the correction one layer early (--kv-correct-at previous_mlp_only: the predicted query's projection,
    the scoring of a share `flagged` of the heads, select_chain before attention, their recall with one program a
    slot, as served). `lanes` picks a subset of the scoring, select_chain and recall."""

    def __init__(self, batch: int, pages: int, layers: int, phase: int, flagged: float, lanes: set[str],
                 recall_programs: int, churn: float, returns: float, victims: int, projection: str = "lane",
                 recall_via: str = "kernel", early_weights: str = "model", dev: str = "cuda"):
        self.phase, self.lanes, self.recall_programs, self.victims = phase, lanes, recall_programs, victims
        self.recall_via = recall_via
        changed = batch * KV_HEADS * 64 * churn
        self.copy = None if recall_via == "kernel" or "recall" not in lanes else \
            CopyRecall(batch, round(changed * (1 - returns)), round(changed * returns), dev)
        self.projection = projection  # the early lane's query projection: on the lane, on the critical lane, none
        early = phase == PHASE_NOW  # PHASE_LATER selects the heads not flagged: flag none so that every head does
        self.x = torch.randn(batch, HIDDEN, device=dev, dtype=torch.bfloat16)
        self.wq = [torch.randn(HIDDEN, HIDDEN, device=dev, dtype=torch.bfloat16) * 0.02
                   for _ in range(layers if early else 0)]
        # --early-weights fp8: W_q as e4m3 rows (nn.Linear's [out, in]) read by fp8_linear, as --kv-early-weights fp8
        self.wq8 = [naive_quantize_rows(w.T.contiguous()) for w in self.wq] if early_weights == "fp8" else None
        self.score_case = sketch_lse.case("llama", batch, pages, flagged if early else 1.0,
                                          seed=batch + pages + early, dev=dev)
        self.c = chain_bench.case(batch, pages, flagged if early else 0.0, seed=batch + early, shape="llama", dev=dev)
        self.select = chain_bench.chain(self.c, "+replay", phase, churn, returns, victims)
        self.recall_args, _ = chain_bench.after_args(self.c, victims)
        if recall_via == "staged":  # the recall kernel reads HBM: the pages the transfer brought
            self.recall_args.update(host=self.recall_args["host"].to(dev), scales=self.recall_args["scales"].to(dev))
        self.calls = 0
        if "recall" in lanes and "chain" not in lanes:  # one selection marks the slots every recall then reads
            self.select(0)

    def project(self, i: int) -> None:
        if self.wq8 is not None:
            fp8_linear(self.x, *self.wq8[i])
        else:
            self.x @ self.wq[i]

    def layer(self, i: int) -> None:
        if self.wq and self.projection == "lane":
            self.project(i)
        if "score" in self.lanes:
            sketch_lse.lse(sketch_lse.served, self.score_case)
        if "chain" in self.lanes:
            self.select(self.calls % 32)
            self.calls += 1
        if "recall" in self.lanes and self.copy is not None:
            self.copy.layer(scatter=self.recall_via == "copy")
        if "recall" in self.lanes and self.recall_via in ("kernel", "staged"):  # the slots select_chain changed
            a, st = self.recall_args, self.select.state
            recall_pages(a["host"], a["k_cache"], a["v_cache"], a["page_table"], st["slots"], self.c["req_slots"],
                         a["slot_pages"], st["recall"], self.phase, a["page_size"], programs=self.recall_programs,
                         victim_ops=st["victim_ops"], victim_base=a["victim_base"], victim_entries=self.victims,
                         host_scales=a["scales"])


def run(layers: int, critical: Critical | None, side: Lane | None = None, stream: torch.cuda.Stream | None = None,
        early: Lane | None = None, early_stream: torch.cuda.Stream | None = None) -> None:
    """Each layer's side lane forked onto `stream` at the layer's start, beside its critical kernels on the current
    stream; with `early`, the next layer's early lane forked onto early_stream at the MLP's start, which that layer's
    attention waits for (as served). Joined at the end."""
    cur = torch.cuda.current_stream()

    def fork(lane, on, i):
        on.wait_stream(cur)
        with torch.cuda.stream(on):
            lane.layer(i)

    for i in range(layers):
        if side is not None:
            fork(side, stream, i)
        if critical is not None:
            critical.qkv(i)
            if early is not None and i:
                cur.wait_stream(early_stream)
            critical.attention(i)
        if early is not None:
            if early.projection == "critical":  # the next layer's predicted query, in line before the MLP
                early.project((i + 1) % layers)
            fork(early, early_stream, (i + 1) % layers)
        if critical is not None:
            critical.mlp(i)
    for lane, on in ((side, stream), (early, early_stream)):
        if lane is not None:
            cur.wait_stream(on)


def timed(fn, repeats: int) -> tuple[float | None, str | None]:
    """(ms of a CUDA graph's replay of fn, captured on the current stream, which keeps its priority; None and the
    reason where the capture fails, e.g. across contexts)."""
    try:
        fn()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=torch.cuda.current_stream()):
            fn()
        return time_ms(lambda i: graph.replay(), repeats, warmup=3), None
    except RuntimeError as e:
        torch.cuda.synchronize()
        return None, str(e).splitlines()[0][:200]


def sms_of(stream: torch.cuda.Stream, programs: int = 4096) -> tuple[int, int | None]:
    """SMs a probe on `stream` touched: eagerly, and replayed from a graph that forks onto it (None if not captured)."""
    with torch.cuda.stream(stream):
        eager = len(sms_touched(programs))
    out = torch.full((programs,), -1, dtype=torch.int32, device="cuda")
    cur, graph = torch.cuda.current_stream(), torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, stream=cur):
            stream.wait_stream(cur)
            with torch.cuda.stream(stream):
                smid_probe(out)
            cur.wait_stream(stream)
    except RuntimeError:
        torch.cuda.synchronize()
        return eager, None
    out.fill_(-1)
    graph.replay()
    torch.cuda.synchronize()
    return eager, len(set(out.tolist()) - {-1})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--pages", type=int, default=1000, help="candidate pages a row (1000: 32K at page 32)")
    ap.add_argument("--layers", type=int, default=8, help="distinct layers (weights, KV), one side lane each")
    ap.add_argument("--sms", default="0,16,24,32,48", help="green-context SMs for the side lane, 0: no green context")
    ap.add_argument("--lanes", default=",".join(LANES), help=f"side-lane kernels, a subset of {','.join(LANES)}")
    ap.add_argument("--early", type=float, default=0.0, metavar="SHARE",
                    help="also the correction one layer early beside each MLP, flagging this share of heads (0.3 as "
                         "realistic-predicted replays; 0: none)")
    ap.add_argument("--early-projection", choices=("lane", "critical", "none"), default="lane",
                    help="where the early lane's query projection runs: on its own stream beside the MLP (served), "
                         "on the critical lane just before the MLP, or nowhere (its share of the lane's cost)")
    ap.add_argument("--early-weights", choices=("model", "fp8"), default="model",
                    help="the early lane's W_q: bf16 (served default) or an e4m3 copy read by fp8_linear "
                         "(--kv-early-weights fp8)")
    ap.add_argument("--recall-via", choices=("kernel", "copy", "dma", "staged"), default="kernel",
                    help="the speculative recall as served (SMs read the host pages), or its GPU side if the host "
                         "gathered them first: copy, one copy-engine transfer, the FP8 pages' conversion and scatter "
                         "and the victim hits' moves as torch ops (CopyRecall); dma, that transfer alone; staged, the "
                         "transfer then the served recall kernel reading a GPU copy of the arena")
    ap.add_argument("--recall-programs", type=int, default=32, help="as --kv-recall-programs (served: 32)")
    ap.add_argument("--warps", default="", metavar="LANE=N,...",
                    help="side kernels launched with other warps than served (thinner CTAs): score (served "
                         f"{sketch_kernels.CHANNEL_WARPS}), chain ({select_kernels.TOPK_SINGLE_WARPS}), recall "
                         f"({recall_kernels.RECALL_WARPS}); the early lane's too")
    ap.add_argument("--attention", choices=("sdpa", "flashinfer", "pages"), default="sdpa",
                    help="the critical lane's attention: SDPA over a dense block, or the served paths over the paged "
                         "layout: FlashInfer's (--kv-attention backend) or attend_pages (--kv-attention fused)")
    ap.add_argument("--pages-splits", type=int, default=None,
                    help="with --attention pages: its programs a (row, KV head) (default: its own choice)")
    ap.add_argument("--churn", type=float, default=0.15)
    ap.add_argument("--returns", type=float, default=0.5)
    ap.add_argument("--victims", type=int, default=64, help="victim entries a head (64: --kv-victim 2048)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", default="results/side_lanes.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/side_lanes.py needs a CUDA device")
    lanes = set(args.lanes.split(","))
    assert lanes <= set(LANES), f"lanes are {LANES}"
    for item in filter(None, args.warps.split(",")):
        lane, n = item.split("=")
        setattr(*WARPS[lane], int(n))
    main_stream = torch.cuda.Stream(priority=CRITICAL_PRIORITY)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"gpu": torch.cuda.get_device_name(), "sms": torch.cuda.get_device_properties(0).multi_processor_count,
              "args": vars(args), "rows": []}
    with torch.cuda.stream(main_stream):
        critical = Critical(args.batch, args.layers, args.attention, args.pages_splits)
        side = Lane(args.batch, args.pages, args.layers, PHASE_LATER, 1.0, lanes, args.recall_programs, args.churn,
                    args.returns, args.victims, recall_via=args.recall_via)
        early = early_stream = None
        if args.early:
            early = Lane(args.batch, args.pages, args.layers, PHASE_NOW, args.early, set(LANES), 0, args.churn,
                         args.returns, args.victims, args.early_projection, early_weights=args.early_weights)
            early_stream = torch.cuda.Stream(priority=EARLY_PRIORITY)

        def timed_run(*lanes_args, **kw):  # every timing replays the same churn draws
            for lane in (side, early):
                if lane is not None:
                    lane.calls = 0
            return timed(lambda: run(args.layers, *lanes_args, **kw), args.repeats)

        print(f"{result['gpu']} ({result['sms']} SMs): {args.layers} layers at {args.batch} rows, side lanes "
              f"{args.lanes} over {args.pages} pages, recall {args.recall_programs} programs, attention "
              f"{args.attention}{'' if args.pages_splits is None else f' ({args.pages_splits} splits)'}; ms a run")
        crit, err = timed_run(critical)
        if crit is None:
            raise SystemExit(f"the critical lane alone was not captured: {err}")
        result.update(critical_ms=crit)
        print(f"critical lane alone {crit:.3f} ms")
        if early is not None:
            with_early, err = timed_run(critical, early=early, early_stream=early_stream)
            result.update(early_ms=with_early, early_error=err)
            print(f"with the early lane ({args.early} flagged) beside each MLP {with_early:.3f} ms "
                  f"(+{with_early - crit:.3f})" if with_early is not None else f"early lane not captured: {err}")
        print(f"{'side SMs':>8} {'sms eager/graph':>15} {'side':>8} {'both':>8} {'excess':>8}"
              + (f" {'all 3':>8} {'excess':>8}" if early is not None else ""))
        for sms in (int(s) for s in args.sms.split(",")):
            row = dict(sms=sms or result["sms"], green=bool(sms), errors=[])
            result["rows"].append(row)
            try:
                ctx, (stream,) = green_streams(sms, 0, 1) if sms else (None, (torch.cuda.Stream(priority=0),))
            except (RuntimeError, ValueError) as e:
                row["errors"].append(str(e))
                print(f"{row['sms']:>8} no green context: {e}")
                continue
            row["touched_eager"], row["touched_graph"] = sms_of(stream)
            row["side_ms"], e1 = timed_run(None, side, stream)
            row["both_ms"], e2 = timed_run(critical, side, stream)
            row["errors"] += [e for e in (e1, e2) if e]
            if early is not None:  # all three lanes, against the critical lane with the early one
                row["all_ms"], e3 = timed_run(critical, side, stream, early, early_stream)
                row["errors"] += [e3] if e3 else []
            seen = f"{row['touched_eager']}/{'-' if row['touched_graph'] is None else row['touched_graph']}"
            if row["side_ms"] is not None and row["both_ms"] is not None:
                row["excess_ms"] = row["both_ms"] - crit
                line = (f"{row['sms']:>8} {seen:>15} {row['side_ms']:>8.3f} {row['both_ms']:>8.3f} "
                        f"{row['excess_ms']:>8.3f}")
                if row.get("all_ms") is not None and result.get("early_ms") is not None:
                    row["all_excess_ms"] = row["all_ms"] - result["early_ms"]
                    line += f" {row['all_ms']:>8.3f} {row['all_excess_ms']:>8.3f}"
                print(line)
            else:
                print(f"{row['sms']:>8} {seen:>15} not captured: {row['errors']}")
            out.write_text(json.dumps(result, indent=2))  # what is measured survives a later failure or a kill
            del ctx
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")

if __name__ == "__main__":
    main()
