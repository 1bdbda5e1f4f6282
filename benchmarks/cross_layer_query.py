"""Can a layer's decode query be predicted one layer early, so the correction leaves the critical path? (CPU study,
a real model; issue 23.)

FreeKV corrects a KV head whose query turned (group-mean cosine of q_i and q_{i-1} below tau): it scores, selects
and recalls that head's pages after the layer's QKV projection and before its attention, on the critical path
(at a correction rate of 0.3 that chain is ~100 us a layer at 16 x 32K on the Llama-3.1-8B shape: the gap between
0.557x of full KV and the 0.386x floor). Layer L's input is layer L-1's mid residual (after its attention) plus
L-1's MLP, and residual streams move little per layer, so q^_L = RoPE(W_q^L norm_L(mid_{L-1})) is known while
layer L-1's MLP runs. If q^ selects nearly what q_L does, the check and the correction can run beside that MLP.

Per decode step, sparse layer (not the first) and KV head, each query below picks the budget's pages among the
candidates (past the sink, before the window) by its own exact page attention mass (softmax per query head, mean
over the group: MeanS on exact keys, so only the query differs); the table gives the true attention mass (q_L's)
those pages, the sink and the window cover, averaged over (step, layer, head):
  oracle       q_L itself
  stale        q_{L, i-1} (the speculative selection of the previous step)
  freekv       stale, but q_L where cos(q_L, q_{L, i-1}) < tau (the method's correction)
  pred_mid     q^ from mid_{L-1} (overlaps layer L-1's MLP)
  pred_in      q^ from layer L-1's input (overlaps its attention and MLP too)
  freekv_mid   stale, but q^_mid where cos(q^_mid, q_{L, i-1}) < tau (the correction one layer early)
  two_stage    freekv_mid, then q_L where cos(q_L, the query freekv_mid selected with) < tau: the method's check
               against the selection in place, on the critical path only for the heads the early one missed
  pred_mid_rN  pred_mid through a rank-N approximation of W_q (--ranks; its truncated SVD): on the Llama-3.1-8B shape
               the prediction re-reads W_q, 32 MB a layer, which a rank-N factor pair cuts to 2 * 4096 * N * 2 bytes
  pred_mid_Q   pred_mid through W_q stored as Q (--quant: fp8, e4m3 with a scale per output row; fp8_rows, e4m3 with
               a power-of-two scale per output row, as --kv-early-weights fp8 serves it (freekv_kernels.fp8_rows);
               int4, symmetric in
               groups of 128 inputs, or 64 where 128 does not divide them): half or a quarter of the 32 MB a layer
               the prediction re-reads on the Llama-3.1-8B shape; freekv_mid_Q, freekv_mid with that prediction
               (its flags and its selection)
  stale_pN     stale, but each step rescoring only the pages this policy selected last and 1 in N of the others (in
               turn; --partial), the rest keeping the mass of the query that last scored them: the speculative
               scoring's work cut to ~1/N
and per query its mean cosine to q_L, the correction rates (freekv; freekv_mid; two_stage's late ones on the critical
path), and how often the flags of freekv and freekv_mid agree.

    python3 benchmarks/cross_layer_query.py --text ../shared/papers/freekv-iclr.txt --context 6000 --new 48
    python3 benchmarks/cross_layer_query.py --task passkey --context 7500 --samples 4   # accuracy-harness prompts
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from freekv_kernels.fp8_rows import naive_quantize_rows
from freekv_sglang.accuracy.tasks import TASKS, make_samples
from freekv_sglang.hf_models import MODELS, load_model

QUERIES = ("oracle", "stale", "freekv", "pred_mid", "pred_in", "freekv_mid", "two_stage")


class Taps:
    """Forward hooks on every decoder layer: its input, its mid residual, its pre-RoPE query (last token)."""

    def __init__(self, model):
        self.h_in, self.h_mid, self.q = {}, {}, {}
        self.handles = []
        for L, layer in enumerate(model.model.layers):
            self.handles.append(layer.register_forward_pre_hook(self._keep(self.h_in, L, arg=True), with_kwargs=True))
            self.handles.append(layer.post_attention_layernorm.register_forward_pre_hook(self._keep(self.h_mid, L)))
            self.handles.append(layer.self_attn.q_proj.register_forward_hook(self._keep_out(self.q, L)))

    @staticmethod
    def _keep(store, L, arg=False):
        if arg:
            def hook(module, args, kwargs):
                h = args[0] if args else kwargs["hidden_states"]
                store[L] = h[:, -1].detach().clone()
            return hook

        def hook(module, args):
            store[L] = args[0][:, -1].detach().clone()
        return hook

    @staticmethod
    def _keep_out(store, L):
        def hook(module, args, out):
            store[L] = out[:, -1].detach().clone()
        return hook


def rope(model, q_pre: torch.Tensor, cos_sin) -> torch.Tensor:
    """A last token's pre-RoPE query [1, Hq * D] -> [Hq, D] at the position cos_sin is for."""
    Hq = model.config.num_attention_heads
    q = q_pre.view(1, 1, Hq, -1).transpose(1, 2)
    return apply_rotary_pos_emb(q, q, *cos_sin)[0][0, :, 0]


def layer_query(model, L: int, h: torch.Tensor, cos_sin, weight: torch.Tensor | None = None) -> torch.Tensor:
    """Layer L's query [Hq, D] if its input were h [1, hidden] (h = its real input gives its real query); with
    weight, through that approximation of W_q instead (a low-rank product, a quantized copy)."""
    q_proj = model.model.layers[L].self_attn.q_proj
    w = q_proj.weight if weight is None else weight
    return rope(model, torch.nn.functional.linear(model.model.layers[L].input_layernorm(h), w, q_proj.bias), cos_sin)


def low_rank(model, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer the rank-`rank` truncated SVD of W_q as (U_r S_r, V_r^T)."""
    out = []
    for layer in model.model.layers:
        u, s, vh = torch.linalg.svd(layer.self_attn.q_proj.weight.float(), full_matrices=False)
        out.append((u[:, :rank] * s[:rank], vh[:rank]))
    return out


QUANTS = ("fp8", "fp8_rows", "int4")
INT4_GROUPS = (128, 64, 32)  # inputs a scale, the largest that divides the row (SmolLM2's 576: 64)


def quantized(model, kind: str) -> list[torch.Tensor]:
    """Per layer W_q as the GPU would store it for the prediction, dequantized to fp32: "fp8" (e4m3, a scale per
    output row, its largest magnitude at e4m3's 448), "fp8_rows" (e4m3 times a power of two per output row: the
    served --kv-early-weights fp8 codec, freekv_kernels.fp8_rows) or "int4" (-8..7, a scale per group of INT4_GROUPS
    inputs, its largest magnitude at 7)."""
    if kind not in QUANTS:
        raise ValueError(f"--quant takes {', '.join(QUANTS)}, got {kind!r}")
    out = []
    for layer in model.model.layers:
        w = layer.self_attn.q_proj.weight.float()
        if kind == "fp8":
            s = w.abs().amax(1, keepdim=True).clamp_min(1e-12) / 448
            out.append((w / s).to(torch.float8_e4m3fn).float() * s)
        elif kind == "fp8_rows":
            q, e = naive_quantize_rows(w)
            out.append(q.float() * torch.exp2(e.float())[:, None])
        else:
            g = w.view(w.shape[0], -1, next((n for n in INT4_GROUPS if w.shape[1] % n == 0), 1))
            s = g.abs().amax(2, keepdim=True).clamp_min(1e-12) / 7
            out.append(((g / s).round().clamp(-8, 7) * s).view_as(w))
    return out


def page_mass(q: torch.Tensor, k: torch.Tensor, group: int, page: int, scale: float) -> torch.Tensor:
    """q [Hq, D], k [H, T, D] -> [H, T // page] attention mass per page, mean over each KV head's query group."""
    H, T, D = k.shape
    qh = q.view(H, group, D)
    p = torch.softmax(torch.einsum("hgd,htd->hgt", qh, k) * scale, dim=-1).mean(1)  # [H, T]
    n = T // page
    return p[:, :n * page].view(H, n, page).sum(-1)


def study(model, taps: Taps, ids: list[int], args, acc: defaultdict, ranks: dict | None = None,
          partial: tuple[int, ...] = (), quants: dict | None = None) -> list[int]:
    """Greedy decode of one prompt, adding each query's statistics to acc; returns the generated tokens. ranks:
    {N: per layer A @ B of low_rank(model, N)} for the pred_mid_rN queries; partial: the N of the stale_pN
    policies; quants: {Q: quantized(model, Q)} for pred_mid_Q and freekv_mid_Q."""
    ranks, quants = ranks or {}, quants or {}
    held: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}  # (N, layer): page masses, selection
    cfg = model.config
    Hq, H = cfg.num_attention_heads, cfg.num_key_value_heads
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // Hq
    G, p, scale = Hq // H, args.page_size, D ** -0.5
    sink_p, win_p, k_sel = args.sink // p, args.window // p, args.budget // p
    layers = model.model.layers
    prev_q: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=True)
        cache, token = out.past_key_values, int(out.logits[0, -1].argmax())
        gen = [token]
        for step in range(args.new + 1):
            pos = len(ids) + step
            out = model(torch.tensor([[token]]), past_key_values=cache, use_cache=True,
                        position_ids=torch.tensor([[pos]]))
            cache, token = out.past_key_values, int(out.logits[0, -1].argmax())
            gen.append(token)
            cos_sin = model.model.rotary_emb(taps.q[0].view(1, 1, -1), torch.tensor([[pos]]))
            for L in range(1, len(layers)):
                q_true = rope(model, taps.q[L], cos_sin)
                preds = {name: layer_query(model, L, h[L - 1], cos_sin)
                         for name, h in (("pred_mid", taps.h_mid), ("pred_in", taps.h_in))}
                approx = {**{f"r{r}": w for r, w in ranks.items()}, **quants}  # per layer W_q's stand-ins
                preds |= {f"pred_mid_{k}": layer_query(model, L, taps.h_mid[L - 1], cos_sin, w[L])
                          for k, w in approx.items()}
                stale, prev_q[L] = prev_q.get(L), q_true
                if stale is None:
                    continue
                keys = cache.layers[L].keys[0] if hasattr(cache, "layers") else cache.key_cache[L][0]  # [H, T, D]
                T = keys.shape[1]
                n_pages = T // p
                cand = slice(sink_p, n_pages - win_p)  # the window's pages and the partial page stay resident
                true = page_mass(q_true, keys, G, p, scale)
                kept = true[:, :sink_p].sum(1) + (1 - true.sum(1)) + true[:, n_pages - win_p:].sum(1)  # [H]
                cos = {name: torch.nn.functional.cosine_similarity(x.view(H, G, D), q_true.view(H, G, D), -1).mean(1)
                       for name, x in (("stale", stale), *preds.items())}
                flag_true = torch.nn.functional.cosine_similarity(q_true.view(H, G, D), stale.view(H, G, D),
                                                                  -1).mean(1) < args.tau
                flag_mid = torch.nn.functional.cosine_similarity(preds["pred_mid"].view(H, G, D), stale.view(H, G, D),
                                                                 -1).mean(1) < args.tau

                def top_of(mass: torch.Tensor) -> torch.Tensor:  # [H, n_pages] bool: the budget's pages by mass
                    m = mass[:, cand]
                    chosen = torch.zeros_like(true, dtype=torch.bool)
                    chosen[:, cand] = torch.zeros_like(m, dtype=torch.bool).scatter_(
                        1, m.topk(min(k_sel, m.shape[1]), dim=1).indices, True)
                    return chosen

                def top(q: torch.Tensor) -> torch.Tensor:  # the budget's pages by q's mass
                    return top_of(page_mass(q, keys, G, p, scale))

                fresh = page_mass(stale, keys, G, p, scale)
                sel = {"oracle": top(q_true), "stale": top_of(fresh), **{name: top(q) for name, q in preds.items()}}
                for n_part in partial:  # stale_pN: the speculative scoring of 1 in N pages a step
                    old, chosen = held.get((n_part, L), (fresh[:, :0], torch.zeros_like(true, dtype=torch.bool)))
                    idx = torch.arange(n_pages)
                    last = torch.nn.functional.pad(chosen.int(), (0, n_pages - chosen.shape[1])).bool()
                    redo = ((idx + step) % n_part == 0)[None] | (idx >= old.shape[1])[None] | last
                    mixed = torch.where(redo, fresh, torch.nn.functional.pad(old, (0, n_pages - old.shape[1])))
                    pick = top_of(mixed)
                    held[(n_part, L)] = (mixed, pick)
                    sel[f"stale_p{n_part}"] = pick
                    acc[f"rescored_p{n_part}"] += float(redo[:, cand].float().mean(1).sum())
                sel["freekv"] = torch.where(flag_true[:, None], sel["oracle"], sel["stale"])
                sel["freekv_mid"] = torch.where(flag_mid[:, None], sel["pred_mid"], sel["stale"])
                for k in quants:  # the early correction with the stored prediction: its flags and its selection
                    flag_k = torch.nn.functional.cosine_similarity(preds[f"pred_mid_{k}"].view(H, G, D),
                                                                   stale.view(H, G, D), -1).mean(1) < args.tau
                    sel[f"freekv_mid_{k}"] = torch.where(flag_k[:, None], sel[f"pred_mid_{k}"], sel["stale"])
                    acc[f"flag_mid_{k}"] += float(flag_k.sum())
                used = torch.where(flag_mid[:, None], preds["pred_mid"].view(H, G * D), stale.view(H, G * D))
                flag_late = torch.nn.functional.cosine_similarity(q_true.view(H, G, D), used.view(H, G, D),
                                                                  -1).mean(1) < args.tau
                sel["two_stage"] = torch.where(flag_late[:, None], sel["oracle"], sel["freekv_mid"])
                acc["flag_late"] += float(flag_late.sum())
                for name, chosen in sel.items():
                    acc[f"mass_{name}"] += float(((true * chosen).sum(1) + kept).sum())
                for name, c in cos.items():
                    acc[f"cos_{name}"] += float(c.sum())
                acc["flag_true"] += float(flag_true.sum())
                acc["flag_mid"] += float(flag_mid.sum())
                acc["flag_agree"] += float((flag_true == flag_mid).sum())
                acc["cases"] += H

    return gen


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--text", help="a natural-language text file; its first --context tokens prompt")
    src.add_argument("--task", choices=sorted(TASKS), help="accuracy-harness prompts of --context tokens instead")
    ap.add_argument("--samples", type=int, default=4, help="--task prompts")
    ap.add_argument("--context", type=int, default=6000)
    ap.add_argument("--new", type=int, default=48, help="measured decode steps (greedy)")
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--sink", type=int, default=32)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--tau", type=float, default=0.9)
    ap.add_argument("--model", default="smollm2", choices=sorted(MODELS))
    ap.add_argument("--ranks", default="", help="comma-separated ranks N of W_q for the pred_mid_rN queries")
    ap.add_argument("--quant", default="", help=f"comma-separated W_q storages ({', '.join(QUANTS)}) for pred_mid_Q "
                    "and freekv_mid_Q")
    ap.add_argument("--partial", default="", help="comma-separated N for the stale_pN policies (1 in N pages rescored)")
    ap.add_argument("--out", default="results/cross-layer-query.json")
    args = ap.parse_args()

    model, tok = load_model(args.model, torch.float32)
    if args.task:
        prompts = [list(x.ids) for x in make_samples(tok, args.task, args.context, args.samples)]
    else:
        ids = tok(Path(args.text).read_text())["input_ids"][:args.context]
        if len(ids) < args.context:
            raise SystemExit(f"{args.text} has {len(ids)} tokens, fewer than --context {args.context}")
        prompts = [ids + tok("\n\nIn short, this paper")["input_ids"]]
    taps, acc = Taps(model), defaultdict(float)
    ranks = {int(r): [a @ b for a, b in low_rank(model, int(r))] for r in args.ranks.split(",") if r}
    partial = tuple(int(n) for n in args.partial.split(",") if n)
    quants = {k: quantized(model, k) for k in args.quant.split(",") if k}
    generated = [tok.decode(study(model, taps, ids, args, acc, ranks, partial, quants)) for ids in prompts]
    n = acc.pop("cases")
    res = {k: v / n for k, v in acc.items()}
    row = {"model": args.model, "prompts": len(prompts), "prompt_tokens": [len(x) for x in prompts], "new": args.new,
           "budget": args.budget, "sink": args.sink, "window": args.window, "page_size": args.page_size,
           "tau": args.tau, "text": args.task or Path(args.text).name,
           "generated": generated, **{k: round(v, 4) for k, v in res.items()}}
    print(json.dumps({k: v for k, v in row.items() if k != "generated"}))
    print("| query | mass covered | cos to q_L |\n| --- | ---: | ---: |")
    for name in (*QUERIES, *(f"pred_mid_r{r}" for r in ranks), *(f"{q}_{k}" for k in quants
                                                                 for q in ("pred_mid", "freekv_mid")),
                 *(f"stale_p{n}" for n in partial)):
        c = res.get(f"cos_{name}")
        print(f"| {name} | {res[f'mass_{name}']:.4f} | {'' if c is None else f'{c:.4f}'} |")
    for n in partial:
        print(f"stale_p{n} rescored {res[f'rescored_p{n}']:.3f} of the candidate pages a step")
    print(f"correction rate: freekv {res['flag_true']:.3f}, freekv_mid {res['flag_mid']:.3f} (flags agree "
          f"{res['flag_agree']:.3f}), two_stage's late ones {res['flag_late']:.3f}"
          + "".join(f", freekv_mid_{k} {res[f'flag_mid_{k}']:.3f}" for k in quants))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(row, indent=1))


if __name__ == "__main__":
    main()
