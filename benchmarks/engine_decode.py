"""FreeKV against LouisKV decode, engine only: retrievals, recalled bytes and step time per step over long outputs.

    python3 benchmarks/engine_decode.py --contexts 32768 --batches 1,4,16 --steps 4096 --out results/engine-decode.json
    python3 benchmarks/engine_decode.py --device cpu --contexts 2048 --batches 1 --steps 8 --layers 2   # smoke
    python3 benchmarks/engine_decode.py --keys structured --contexts 32768 --batches 1,16 --steps 2048

This drives FreeKVEngine directly, as benchmarks/profile_step.py does, so only the retrieval policies' own costs
are timed: Llama-3.1-8B's attention shape (32 layers by default, 32 query / 8 KV heads, head dim 128, bf16), the
first layer dense and left out (as in SGLang, where the wrapped backend runs it), every other layer sparse. There
are no model GEMMs, no norms, no MLPs, no sampling: a step is the engine's plan, per sparse layer its trigger,
selection, recall, KV write, attention (the engine's own split-K Triton kernel, not FlashInfer), offload and the
policy's upkeep, and the join, captured in one CUDA graph and replayed (eager on CPU). Step time is therefore the
attention-side cost of a step only.

Per config (context, batch, policy) each request gets a random prompt (K and V ~ N(0, 1) per layer; LouisKV
clusters it with its k-means at prefill), then `--steps` decode steps with random new K/V and synthetic queries
whose step-to-step similarity is set by two knobs (--keys random, the default), per request, layer and query head:
  q_t = sqrt(D) * normalize(a * normalize(q_{t-1}) + sqrt(1 - a^2) * normalize(noise))   (--similarity a)
so the cosine of adjacent queries is about a (within ~0.03 per head at D 128), and with probability --shift per
step and request every query of the request is drawn afresh (a topic shift, cosine ~0). With the defaults
(a 0.9, shift 0.02) FreeKV's tau 0.9 sits at the cosine, so it flags a good share of heads every step (SmolLM2 on
real prompts: mean cosine 0.84, correction rate 0.72, benchmarks/NOTES.md), while LouisKV's boundary_tau 0.7 fires
at shifts only; a 0.97 makes FreeKV flag little beyond the shifts too. Random keys make attention diffuse: which
pages are selected carries no accuracy meaning here, only how many are recalled and what it costs; and since every
page scores alike, the top-k flips on tiny query changes, so a selector recalls far more than on a real model.

--keys structured: keys, values and queries from benchmarks/realistic_churn.py's StructuredKV instead, whose
attention is concentrated on a few pages of the request's current topic that stay relevant over steps, with query
churn and topic shifts fitted to SmolLM2-135M (NOTES.md, thirteenth session; --similarity is unused, --shift is the
topic-shift rate). --shape smollm2 runs SmolLM2-135M's attention shape (30 layers, 9 / 3 heads, head dim 64), the
geometry the fit was made at; the default is llama8b.

Policies (--policies): freekv (the default selection: the channel sketch, speculative with correction at tau,
calibrated from queries and keys drawn as the workload draws them), freekv-sketch (the one-stage sketch),
freekv-rerank (the two-stage rerank/2 with a 16-channel sketch),
freekv-means (FreeKV with MeanS selection), louiskv (retrieval at semantic boundaries of clusters and segments),
freekv-replay (the default with a real model's correction rate 0.3 and churn 0.15 replayed, as decode.py's
`realistic`), freekv-replay-only (the same replay with selection "replay": no scoring); a FreeKV policy with a
suffix /hH (e.g. freekv/h1) selects with FreeKVConfig.hysteresis H, /rN runs the speculative recall on N programs,
/vT keeps a victim cache of T tokens and /bS (with the replay and /vT) returns that share of the churn to its pages.
Reported per config, over the timed steps (after --warmup steps that fill the slots):
  retrieval_share     FreeKV: the share of (request, sparse layer, KV head) checks flagged for correction (they
                      select and recall before attention); LouisKV: the share of (request, sparse layer) steps at a
                      semantic boundary (engine.stats() counts a boundary as all heads of the row flagged)
  recall_mb_per_step  K+V bytes recalled host->GPU per step, all requests and layers (before attention / after)
  changed_share       pages recalled per (request, sparse layer, KV head) and step over the budget's pages: the share
                      of the selection that changes per step (FreeKV: before attention and speculative together;
                      from the host or from the victim cache)
  victim_hit_share    of those pages, the share taken from the victim cache (policy suffix /vT) instead of the host
  step_ms             median (and mean, p90) time of one step over all requests: the graph's replay, synchronised
                      before and after; the host's prepare_step and the query drift run outside the timed region
With --probe (the default on CPU; eager steps only, it reads the host arena every layer), also the probe's
statistics of benchmarks/realistic_churn.py: attention mass of the best k pages (topk_mass), of the best page, of the
selection (covered_mass), and the share of the best k pages that change per step (oracle_change). The probe runs
inside the step, so its step times are not speed figures.
Rows go to --out as JSON, merged by (context, batch, policy, layers, keys, shape, similarity, shift, steps), so
configs can be run in several invocations (each GPU command is limited in time). The host arena keeps every layer:
batch x (context + steps) x 128 KiB at the Llama shape's 32 layers (batch 16 at 32K: 77 GB). A config whose arena
exceeds --host-gb runs with fewer layers instead, as many as fit (the row's `layers` says how many and
`layers_reduced_from` what was asked): step time and bytes scale with the sparse layers, shares do not. If
registering the arena with CUDA fails anyway, the config is skipped with the error in the row.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from freekv_sglang.calibration import calibrate_synthetic, gaussian_sample
from freekv_sglang.config import FreeKVConfig
from freekv_sglang.engine import FreeKVEngine, ModelShape

sys.path.insert(0, str(Path(__file__).resolve().parent))
from realistic_churn import STRUCTURED, ChurnProbe, StructuredKV, counters, summarize  # noqa: E402

PHASE_NAMES = {"before_attention": "now", "speculative": "after"}  # row names of the engine's timing phases
PROBED = ("topk_mass", "top1_mass", "covered_mass", "oracle_change", "cos_mean", "changed_share_now")
# Attention shapes (layers, query heads, KV heads, head dim).
SHAPES = {"llama8b": (32, 32, 8, 128), "smollm2": (30, 9, 3, 64)}
DEFAULTS = FreeKVConfig()
POLICIES = {
    "freekv": dict(retrieval="freekv"),
    "freekv-sketch": dict(retrieval="freekv", selection="sketch"),  # the default in sessions 16-23
    "freekv-rerank": dict(retrieval="freekv", selection="rerank", sketch_channels=16),  # the default before session 16
    "freekv-means": dict(retrieval="freekv", selection="means"),
    # A real model's correction rate and selection churn replayed (benchmarks/decode.py's `realistic`), with the
    # default selection's scoring / none (the replay's draws alone): their difference is the scoring's cost.
    "freekv-replay": dict(retrieval="freekv", replay_correction_rate=0.3, replay_churn=0.15),
    "freekv-replay-only": dict(retrieval="freekv", selection="replay", replay_correction_rate=0.3, replay_churn=0.15),
    "louiskv": dict(retrieval="louiskv"),
}
KNOB_SUFFIXES = {"h": ("hysteresis", float), "r": ("recall_programs", int), "v": ("victim", int),
                 "b": ("replay_returns", float)}


def host_bytes(batch: int, context: int, layers: int, shape: str = "llama8b", dtype_bytes: int = 2) -> int:
    _, _, H, D = SHAPES[shape]
    return batch * context * layers * H * 2 * D * dtype_bytes


def unit(x: torch.Tensor) -> torch.Tensor:
    return x / x.float().norm(dim=-1, keepdim=True).clamp_min(1e-6).to(x.dtype)


class Queries:
    """The static query buffer q [L, B, Hq, D] and its per-step drift (see the module docstring)."""

    def __init__(self, layers: int, batch: int, hq: int, d: int, similarity: float, shift: float, device, dtype,
                 seed: int):
        self.gen = torch.Generator(device=device).manual_seed(seed)
        self.a, self.b, self.shift = similarity, math.sqrt(max(0.0, 1 - similarity ** 2)), shift
        self.scale = math.sqrt(d)
        self.q = unit(self._randn(layers, batch, hq, d)).mul_(self.scale).to(dtype)
        self.shifts = torch.zeros((), dtype=torch.int64, device=device)  # fresh draws so far (no host sync)

    def _randn(self, *shape):
        return torch.randn(*shape, generator=self.gen, device=self.gen.device, dtype=torch.float32)

    def advance(self) -> None:
        q = unit(self.q.float())
        new = unit(self.a * q + self.b * unit(self._randn(*q.shape)))
        fresh = torch.rand(q.shape[1], generator=self.gen, device=self.gen.device) < self.shift  # [B]
        new = torch.where(fresh[None, :, None, None], unit(self._randn(*q.shape)), new)
        self.shifts += fresh.sum()
        self.q.copy_(new.mul_(self.scale))


class Structured:
    """--keys structured: StructuredKV's queries and new K/V copied into the step's static buffers."""

    def __init__(self, gen: StructuredKV, dtype):
        self.gen = gen
        self.q = gen.queries().to(dtype)
        self.kv = gen.step_kv().to(dtype)
        self.shifts = gen.shifts

    def advance(self) -> None:
        self.gen.advance()
        self.q.copy_(self.gen.queries())
        self.kv.copy_(self.gen.step_kv())


def policy_knobs(policy: str) -> dict:
    """POLICIES[name] for "name", plus FreeKVConfig.hysteresis H for a suffix "/hH", recall_programs N for "/rN",
    victim T tokens for "/vT" and replay_returns S for "/bS" (e.g. "freekv-replay/r128", "freekv-replay/v2048/b0.5")."""
    name, *suffixes = policy.split("/")
    knobs = dict(POLICIES[name])
    for suffix in suffixes:
        field, kind = KNOB_SUFFIXES[suffix[:1]]
        knobs[field] = kind(suffix[1:])
    return knobs


def trace_steps(run, advance, sync, path: str, steps: int = 4) -> None:
    """A chrome trace of `steps` more steps (kernels of a replayed graph included) for benchmarks/trace_summary.py."""
    from torch.profiler import ProfilerActivity, profile

    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            advance()
            run()
        sync()
    prof.export_chrome_trace(path)


def run_config(args, context: int, batch: int, policy: str, layers: int) -> dict:
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    _, HQ, H, D = SHAPES[args.shape]
    L, probe = layers, args.probe
    graph = args.graph and dev.type == "cuda" and not probe
    cfg = FreeKVConfig(budget=args.budget, sink=args.sink, window=args.window, page_size=args.page_size,
                       tau=args.tau, dense_layers=1, boundary_tau=args.boundary_tau, **policy_knobs(policy))
    max_context = context + args.warmup + args.steps + 8
    max_pages = -(-max_context // args.page_size)
    eng = FreeKVEngine(cfg, ModelShape(L, HQ, H, D), max_requests=batch + 1, max_context=max_context, dtype=dtype,
                       device=dev, backend=args.backend, pad_slot=0, dense_outside=True,
                       host_pages=batch * max_pages)
    gen = torch.Generator(device=dev).manual_seed(args.seed)
    structured = None
    if args.keys == "structured":
        # The same seed for every policy of a config: they see the same keys and queries.
        structured = StructuredKV(L, batch, HQ, H, D, context, dev, args.seed, **{**STRUCTURED, "shift": args.shift})
    # The channel sketch (the default selection) calibrates from queries and keys drawn as this workload draws them.
    calibrate_synthetic(eng, gaussian_sample(eng, args.seed) if structured is None else
                        structured.calibration_sample(args.page_size))
    slots = list(range(1, batch + 1))
    t0 = time.perf_counter()
    for row, s in enumerate(slots):
        eng.add_request(s)
        eng.begin_prefill(s, context)
        if structured is not None:
            prompt = structured.prompt(row, context, args.page_size)
            next(prompt)  # layer 0 is dense and outside
            q_last = structured.queries()
        for layer in range(1, L):
            if structured is not None:
                k, v = (x.to(dtype) for x in next(prompt))
                eng.prefill_layer(s, layer, k, v, q_last[layer, row].to(dtype))
                continue
            k, v = (torch.randn(context, H, D, generator=gen, device=dev, dtype=torch.float32).to(dtype)
                    for _ in range(2))
            eng.prefill_layer(s, layer, k, v, torch.randn(HQ, D, generator=gen, device=dev).to(dtype))
    if dev.type == "cuda":
        torch.cuda.synchronize()
    prefill_s = time.perf_counter() - t0

    if structured is not None:
        queries = Structured(structured, dtype)
        kv = queries.kv
    else:
        queries = Queries(L, batch, HQ, D, args.similarity, args.shift, dev, dtype, args.seed + 1)
        kv = torch.zeros(2, L, batch, H, D, device=dev, dtype=dtype)
    q = queries.q
    lens = [context]
    churn = eng.probe = ChurnProbe(eng) if probe else None
    # Before the capture: the graph holds the events.
    timing = args.step_timing and eng.enable_step_timing(sample_layers=args.timed_layers)

    def step():
        plan = eng.plan(batch)
        for layer in range(1, L):
            eng.attend(plan, layer, q[layer], kv[0, layer], kv[1, layer])
        eng.end_step()

    def advance():
        lens[0] += 1
        eng.prepare_step(slots, lens=[lens[0]] * batch)
        queries.advance()
        if structured is None:
            kv.normal_(generator=gen)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    for _ in range(min(3, args.warmup)):  # eager: compiles the kernels and fills the slots
        advance()
        step()
    run = step
    if graph:
        from profile_step import capture

        advance()
        g = capture(step, between=advance)  # runs one step on a side stream, then advances and captures
        g.replay()  # the step `between` advanced to
        run = g.replay
    for _ in range(max(0, args.warmup - 3)):
        advance()
        run()
    sync()
    before, shifts0 = eng.stats(), queries.shifts.clone()
    if churn is not None:
        churn.active, counts0 = True, counters(eng)
    times, phase_ms = [], {}
    for _ in range(args.steps):
        advance()
        sync()
        t = time.perf_counter()
        run()
        sync()
        times.append((time.perf_counter() - t) * 1e3)
        if timing:  # outside the timed region (it synchronises again)
            for kind, by_phase in eng.step_times().items():
                for phase, sec in by_phase.items():
                    phase_ms.setdefault(f"{kind}_ms_{PHASE_NAMES[phase]}", []).append(sec * 1e3)
    after = eng.stats()
    if args.trace and dev.type == "cuda":  # after the counted steps: a few more under torch's profiler
        name = f"trace-{context}-{batch}-{policy.replace('/', '_')}.json.gz"
        trace_steps(run, advance, sync, os.path.join(args.trace, name))
    n = args.steps
    checks = after["checks"] - before["checks"]
    flagged = after["flagged"] - before["flagged"]
    page_bytes = after["recall_page_bytes"]
    now = (after["recall_pages_now"] - before["recall_pages_now"]) * page_bytes
    later = (after["recall_pages_speculative"] - before["recall_pages_speculative"]) * page_bytes
    hits = sum(after[k] - before[k] for k in ("victim_hits_now", "victim_hits_speculative"))
    times.sort()
    row = {"context": context, "batch": batch, "policy": policy, "layers": L, "sparse_layers": L - 1,
           "keys": args.keys, "shape": args.shape, "heads": [HQ, H, D],
           "similarity": args.similarity if structured is None else None, "shift": args.shift, "steps": n,
           "graph": graph,
           "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
           "budget": cfg.budget, "page_size": cfg.page_size, "tau": cfg.tau, "boundary_tau": cfg.boundary_tau,
           "selection": cfg.selection if policy != "louiskv" else None,
           "retrieval_share": round(flagged / max(checks, 1), 4),
           "retrieving_heads_per_step": round(flagged / n, 2),
           "recall_mb_per_step": round((now + later) / n / 1e6, 3),
           "recall_mb_per_step_now": round(now / n / 1e6, 3),
           "recall_mb_per_step_after": round(later / n / 1e6, 3),
           "changed_share": round(((now + later) / page_bytes + hits) / (n * batch * (L - 1) * H * cfg.select_pages),
                                  4),
           "victim_hit_share": round(hits / max((now + later) / page_bytes + hits, 1), 4),
           "step_ms": round(statistics.median(times), 3), "step_ms_mean": round(statistics.fmean(times), 3),
           "step_ms_p90": round(times[int(0.9 * (n - 1))], 3), "prefill_s": round(prefill_s, 2)}
    row["query_shift_share"] = round(int(queries.shifts - shifts0) / (n * batch), 4)
    row["step_timing"] = len(eng.timer.layers) if timing else 0  # timed sparse layers
    row.update({name: round(statistics.median(v), 3) for name, v in phase_ms.items()})
    if churn is not None:
        row["probe"] = summarize(churn, eng, counts0, n, batch)
        row.update({key: row["probe"]["mean"][key] for key in PROBED})
    del eng
    return row


def row_key(r: dict) -> tuple:
    return tuple(r.get(k) for k in ("context", "batch", "policy", "layers", "keys", "shape", "similarity", "shift",
                                    "steps", "device", "tau", "step_timing"))


def table(rows: list[dict]) -> str:
    head = ("| keys | context | batch | layers | policy | tau | retrieval share | changed share | MB recalled / step "
            "(before attn / after) | step ms (median / p90) | selection ms (before attn / after) | top-k mass | "
            "oracle change |\n"
            "| --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    lines = [head]
    for r in rows:
        first = (f"| {r.get('keys', 'random')} | {r['context']} | {r['batch']} | {r['layers']} | {r['policy']} | "
                 f"{r.get('tau', '')} |")
        if "skipped" in r:
            lines.append(f"{first} skipped: {r['skipped']} | | | | | | |")
            continue
        probed = (f"{r['topk_mass']:.3f} | {r['oracle_change']:.3f}" if "topk_mass" in r else "- | -")
        timed = (f"{r['selection_ms_now']:.3f} / {r.get('selection_ms_after', 0.0):.3f}" if "selection_ms_now" in r
                 else "-")
        lines.append(f"{first} {r['retrieval_share']:.4f} | {r['changed_share']:.3f} | "
                     f"{r['recall_mb_per_step']:.2f} ({r['recall_mb_per_step_now']:.2f} / "
                     f"{r['recall_mb_per_step_after']:.2f}) | {r['step_ms']:.3f} / {r['step_ms_p90']:.3f} | {timed} | "
                     f"{probed} |")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="32768,131072", help="prompt tokens per request")
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--policies", default="freekv,freekv-means,louiskv",
                    help=f"from {','.join(POLICIES)}; a FreeKV policy with /hH: with FreeKVConfig.hysteresis H, "
                         "/rN: with recall_programs N")
    ap.add_argument("--steps", type=int, default=4096, help="timed decode steps (the paper's long outputs: >= 4K)")
    ap.add_argument("--warmup", type=int, default=16, help="untimed steps first (at least 3 are eager)")
    ap.add_argument("--layers", type=int, default=None, help="model layers (default: the shape's); the first is "
                    "dense and left out")
    ap.add_argument("--keys", choices=("random", "structured"), default="random",
                    help="random N(0, 1) keys with drifting queries, or StructuredKV's topic structure")
    ap.add_argument("--shape", choices=tuple(SHAPES), default="llama8b", help="attention shape")
    ap.add_argument("--similarity", type=float, default=0.9, help="--keys random: adjacent-query cosine a")
    ap.add_argument("--shift", type=float, default=None, help="per step and request: chance of a fresh query "
                    "(random, default 0.02) or of a topic shift (structured, default the fitted STRUCTURED's)")
    ap.add_argument("--budget", type=int, default=DEFAULTS.budget)
    ap.add_argument("--sink", type=int, default=DEFAULTS.sink)
    ap.add_argument("--window", type=int, default=DEFAULTS.window)
    ap.add_argument("--page-size", type=int, default=DEFAULTS.page_size)
    ap.add_argument("--tau", type=float, default=DEFAULTS.tau, help="FreeKV's correction threshold")
    ap.add_argument("--boundary-tau", type=float, default=DEFAULTS.boundary_tau, help="LouisKV's threshold")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default=None, help="default: bf16 on cuda, fp32 on cpu")
    ap.add_argument("--backend", default=None, help="engine ops: triton (cuda default) or torch (cpu default)")
    ap.add_argument("--no-graph", dest="graph", action="store_false", help="eager steps on cuda too")
    ap.add_argument("--probe", action=argparse.BooleanOptionalAction, default=None,
                    help="attention statistics per step (default: on for cpu; eager steps only)")
    # 65 GiB failed to register with CUDA on a 128 GB H100 host (batch 16 at 32K, 32 layers): stay well below it.
    ap.add_argument("--host-gb", type=float, default=40.0,
                    help="host arena limit: a config above it runs with as many layers as fit")
    ap.add_argument("--step-timing", action="store_true",
                    help="GPU: time each step's selection and recall per phase with the engine's timing events (as "
                         "the server does with --enable-metrics) and report their medians; the events sit in the "
                         "graph, so step_ms then includes their cost")
    ap.add_argument("--timed-layers", type=int, default=None,
                    help="--step-timing in this many sparse layers spread over the depth, scaled to all (the server "
                         "times 4); default every sparse layer")
    ap.add_argument("--trace", default=None, help="GPU: a directory for a torch-profiler trace of 4 more steps per "
                    "config, after the timed ones")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="results/engine-decode.json")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    args.dtype = args.dtype or ("bf16" if args.device.startswith("cuda") else "fp32")
    args.layers = args.layers or SHAPES[args.shape][0]
    if args.shift is None:
        args.shift = 0.02 if args.keys == "random" else STRUCTURED["shift"]
    args.probe = args.device == "cpu" if args.probe is None else args.probe
    if not 0 <= args.similarity <= 1 or not 0 <= args.shift <= 1:
        raise SystemExit("--similarity and --shift must lie in [0, 1]")
    if args.layers < 2 or args.steps < 1:
        raise SystemExit("--layers must be >= 2 (one dense, one sparse) and --steps >= 1")
    policies = [p for p in args.policies.split(",") if p]
    bad = []
    for p in policies:
        try:
            policy_knobs(p)
        except (KeyError, ValueError):  # an unknown name or suffix, or a suffix without its number
            bad.append(p)
    if bad:
        raise SystemExit(f"unknown policies {bad}; choose from {list(POLICIES)}")
    out = Path(args.out)
    old = json.loads(out.read_text())["rows"] if out.exists() else []
    rows: list[dict] = []

    def save():
        keys = {row_key(r) for r in rows}
        merged = [r for r in old if row_key(r) not in keys] + rows
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"rows": merged, "note": "attention-side step only: no model GEMMs"}, indent=1))

    dtype_bytes = 2 if args.dtype == "bf16" else 4
    for context in [int(x) for x in args.contexts.split(",")]:
        for batch in [int(x) for x in args.batches.split(",")]:
            for policy in policies:
                tokens = context + args.warmup + args.steps + 8
                per_layer = host_bytes(batch, tokens, 1, args.shape, dtype_bytes)
                layers = min(args.layers, int(args.host_gb * 1e9 // per_layer))
                note = {"context": context, "batch": batch, "policy": policy, "layers": layers, "keys": args.keys,
                        "shape": args.shape, "similarity": args.similarity if args.keys == "random" else None,
                        "shift": args.shift, "steps": args.steps}
                if layers < 2:
                    r = {**note, "skipped": f"host arena {2 * per_layer / 1e9:.0f} GB at 2 layers > --host-gb "
                                            f"{args.host_gb:g}"}
                else:
                    try:
                        r = run_config(args, context, batch, policy, layers)
                    except RuntimeError as err:  # cudaHostRegister refusing the arena: note it, go on
                        r = {**note, "skipped": f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"}
                    if layers < args.layers:
                        r["layers_reduced_from"] = args.layers
                        r["note"] = (f"host arena {args.layers * per_layer / 1e9:.0f} GB at {args.layers} layers > "
                                     f"--host-gb {args.host_gb:g}: ran {layers} layers")
                print(json.dumps({k: v for k, v in r.items() if k != "probe"}), flush=True)
                rows.append(r)
                save()
                # The config's engine sits in reference cycles (its probe, the captured graph's closures): collect
                # them now, so its registered host arena is released before the next config registers its own.
                gc.collect()
                if args.device.startswith("cuda"):
                    torch.cuda.empty_cache()
    save()
    print(table(rows))
    print(f"attention-side step only (no model GEMMs); rows merged into {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
