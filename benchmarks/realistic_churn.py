"""Realistic query churn for the engine-only benchmarks: a generator of keys and queries with the structure of a real
model's decode attention, and the probe that measures that structure the same way on the real model and on the
generator (benchmarks/churn.py on SmolLM2, benchmarks/engine_decode.py --keys structured).

The generator (StructuredKV). With N(0, 1) keys every page scores alike, so the top-k flips on tiny query changes and
the engine recalls far more than a real model makes it (NOTES.md, thirteenth session). A real model's decode query
reads a few pages that stay relevant over many steps, and its tail of the top-k churns with the query. Per (sparse
layer, KV head):
  - T topic directions u_1..u_T (random unit vectors in R^D; the requests differ in which topic each page holds).
    The context is a sequence of segments of geometric length (mean seg_tokens), each on a uniformly drawn topic,
    so topics recur over the context as in a long text and the current topic holds about 1/T of it.
  - keys k_i = kappa_h (1 + sigma g_j) u_{z_j} + content c_j + eps_i for token i of page j: the segment's topic with
    a page strength (g_j ~ N(0, 1)), a page content vector c_j ~ N(0, I) shared by the page's tokens (what a page is
    about beyond its topic), and token noise eps_i ~ N(0, I). kappa_h = kappa x LogNormal(0, kappa_spread).
  - queries q_g = sqrt(D) unit(alpha u_c + sqrt(1 - alpha^2) xi_g) per query head g of the group, u_c the request's
    current topic and xi_g a unit AR(1) process, the content the query asks for: xi_g <- unit(rho_t xi_g +
    sqrt(1 - rho_t^2) n). The adjacent-query cosine is then about alpha^2 + (1 - alpha^2) rho_t, with
    1 - rho_t = (1 - rho) e_h s_t: e_h ~ LogNormal(0, head_spread) per (layer, KV head) (some heads' queries barely
    move, others much) and s_t ~ LogNormal(-step_spread^2 / 2, step_spread) per (request, step), shared by every
    head (a surprising token moves every query at once).
  - with probability `shift` per step a request moves to another topic (every layer and head) and its xi are
    drawn afresh: the speculative selection is then wrong and the cosine check sees it.
  - the step's new keys are on the current topic (what is written is what is being read about), values N(0, 1).
The engine's logits are unit(q) . k: alpha kappa_h (1 + sigma g_j) on pages of the current topic, plus
content (alpha u_c + sqrt(1 - alpha^2) xi) . c_j per page (a part fixed while the topic holds, how the page relates
to it, and a part that moves with xi; each ~N(0, 1) times its weight), plus N(0, 1) per token. So the mass sits on
the current topic's pages, ordered by strength and by how well their content matches the query; the moving content
term reorders the tail of the top-k as xi drifts, the topic term keeps the head of it. The terms are in logit units
and do not depend on D (the page size does matter: a page's log-sum-exp averages its tokens' noise).
The number of topics grows with the prompt as distinct words grow with a text (Heaps' law): T = topics x
(context / 4096)^heaps. STRUCTURED holds the parameters fitted to SmolLM2-135M's statistics (benchmarks/churn.py;
NOTES.md, thirteenth session).

The probe (ChurnProbe), installed as engine.probe: per sparse layer, over (row, KV head) cases after attention,
from the exact keys of the candidate pages (eager, CPU or small shapes only: it reads the host arena):
  topk_mass       the attention mass (group mean over query heads, normalised over the candidate pages) of the k
                  pages with the most mass, k = the budget's pages: how concentrated attention is
  top1_mass       the same for the single best page
  covered_mass    the mass of the pages the selection attended
  oracle_change   the share of the k best pages that were not among the k best of the previous step (the churn the
                  model's attention itself has, whatever the selector)
  cos_mean/std    the group-mean cosine of adjacent queries per KV head (what the correction check thresholds)
  boundary        the share of (row, layer) steps whose mean cosine over all query heads is below 0.7 (LouisKV's
                  semantic boundary at its default threshold)
  victim_hit_F    of the pages the selection attends that it did not attend at the previous step (what recall moves),
                  the share that a GPU victim cache of F x the budget's pages per (row, layer, KV head) would hold:
                  the pages that left the attended set, least recently evicted dropped first (F in VICTIM_SIZES;
                  the cache starts empty at the first measured step)
"""

from __future__ import annotations

import copy
import math
from collections import defaultdict

import torch

from freekv_sglang.selectors import page_attention_mass

# LouisKV's default threshold on the mean adjacent cosine over a row's query heads (FreeKVConfig.boundary_tau): the
# share of steps below it is how often a real model's queries jump, which the topic shifts stand for.
BOUNDARY_TAU = 0.7
# Victim cache capacities, in budgets, of the victim-hit statistic.
VICTIM_SIZES = (0.25, 0.5, 1.0, 2.0, 3.0, 4.0)
# Edges of the adjacent queries' group-mean cosine per KV head: how much the selection changes at each similarity,
# i.e. how much speculative reselection a head whose query barely turned would save by skipping it (session 54).
COS_EDGES = (0.9, 0.95, 0.98, 0.99, 0.995)
# Generator parameters fitted to SmolLM2-135M on CPU (NOTES.md, thirteenth session).
STRUCTURED = dict(topics=12, heaps=0.5, seg_tokens=256, kappa=3.0, kappa_spread=0.0, sigma=0.2, content=1.75, alpha=0.8,
                  rho=0.6, head_spread=0.3, step_spread=0.35, shift=0.01)


def unit(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=-1, keepdim=True).clamp_min(1e-6)


class StructuredKV:
    """Keys, values and queries with topic structure (module docstring) for `batch` requests of `context` prompt
    tokens. Layers are indexed as the engine's; all state lives on `device` in fp32 (the caller casts)."""

    def __init__(self, layers: int, batch: int, q_heads: int, kv_heads: int, head_dim: int, context: int, device,
                 seed: int, *, topics: float, heaps: float, seg_tokens: int, kappa: float, kappa_spread: float,
                 sigma: float, content: float, alpha: float, rho: float, head_spread: float, step_spread: float,
                 shift: float):
        self.L, self.B, self.Hq, self.H, self.D = layers, batch, q_heads, kv_heads, head_dim
        self.G = q_heads // kv_heads
        # Topics in a prompt of `context` tokens: Heaps' law, as distinct words grow with a text's length.
        self.T = max(2, round(topics * (context / 4096) ** heaps))
        self.seg, self.sigma, self.alpha, self.shift = seg_tokens, sigma, alpha, shift
        self.step_spread, self.content = step_spread, content
        self.dev = torch.device(device)
        self.gen = torch.Generator(device=self.dev).manual_seed(seed)
        self.u = unit(self._randn(layers, kv_heads, self.T, head_dim))  # [L, H, T, D]
        # Per (layer, KV head): focus kappa_h and how far its query's content part moves per step.
        self.kappa = kappa * torch.exp(kappa_spread * self._randn(layers, kv_heads))
        self.one_minus_rho = ((1 - rho) * torch.exp(head_spread * self._randn(layers, kv_heads))).clamp(max=2.0)
        self.topic = torch.zeros(batch, dtype=torch.int64, device=self.dev)  # the current topic per request
        self.xi = unit(self._randn(layers, batch, q_heads, head_dim))
        self.shifts = torch.zeros((), dtype=torch.int64, device=self.dev)  # topic shifts so far (no host sync)

    def _randn(self, *shape):
        return torch.randn(*shape, generator=self.gen, device=self.dev, dtype=torch.float32)

    def _rand(self, *shape):
        return torch.rand(*shape, generator=self.gen, device=self.dev, dtype=torch.float32)

    def _randint(self, high: int, *shape):
        return torch.randint(high, shape, generator=self.gen, device=self.dev)

    def prompt_topics(self, context: int) -> torch.Tensor:
        """Topic of every prompt token [context]: segments of geometric length, each on a uniformly drawn topic."""
        z = torch.empty(context, dtype=torch.int64, device=self.dev)
        i = 0
        p_end = 1.0 / max(self.seg, 1)
        while i < context:
            n = int(math.ceil(math.log(max(float(self._rand(1)), 1e-12)) / math.log1p(-p_end))) if p_end < 1 else 1
            z[i:i + n] = int(self._randint(self.T, 1))
            i += n
        return z

    def keys(self, layer: int, z: torch.Tensor, page_size: int) -> torch.Tensor:
        """Keys [n, H, D] of tokens on topics z [n] (page strengths drawn per page of page_size tokens)."""
        n, pages = z.shape[0], -(-z.shape[0] // page_size)
        w = (1 + self.sigma * self._randn(pages, self.H)).repeat_interleave(page_size, 0)[:n]
        c = self._randn(pages, self.H, self.D).repeat_interleave(page_size, 0)[:n]
        mean = (self.kappa[layer] * w)[..., None] * self.u[layer][:, z].transpose(0, 1)  # [n, H, D]
        return mean + self.content * c + self._randn(n, self.H, self.D)

    def prompt(self, row: int, context: int, page_size: int):
        """Per layer (K, V) [context, H, D] of request `row`'s prompt; its current topic becomes the last segment's."""
        z = self.prompt_topics(context)
        self.topic[row] = z[-1]
        for layer in range(self.L):
            yield self.keys(layer, z, page_size), self._randn(context, self.H, self.D)

    def calibration_sample(self, page_size: int, seed: int = 1):
        """sample(layer, n) for freekv_sglang.calibration.calibrate_synthetic: n keys of a fresh prompt and n queries
        (the requests' current ones, repeated), drawn with a generator of their own so the workload's draws do not
        move."""
        twin = copy.copy(self)
        twin.gen = torch.Generator(device=self.dev).manual_seed(seed)

        def sample(layer: int, n: int):
            k = twin.keys(layer, twin.prompt_topics(n), page_size)
            q = twin.queries()[layer].reshape(-1, self.Hq, self.D)
            return q.repeat(-(-n // q.shape[0]), 1, 1)[:n], k

        return sample

    def queries(self) -> torch.Tensor:
        """q [L, B, Hq, D] with norm sqrt(D) (logits unit(q) . k after the engine's 1 / sqrt(D))."""
        u = self.u[:, :, self.topic]  # [L, H, B, D]
        u = u.permute(0, 2, 1, 3).repeat_interleave(self.G, dim=2)  # [L, B, Hq, D]
        a = self.alpha
        return unit(a * u + math.sqrt(1 - a * a) * self.xi) * math.sqrt(self.D)

    def step_kv(self) -> torch.Tensor:
        """This step's new K/V [2, L, B, H, D]: keys on each request's current topic. Strength and content are drawn
        per token, so a page written during decode is an average page of its topic (its tokens' draws average out)."""
        w = 1 + self.sigma * self._randn(self.L, self.B, self.H)
        u = self.u[:, :, self.topic].permute(0, 2, 1, 3)  # [L, B, H, D]
        k = (self.kappa[:, None] * w)[..., None] * u + self.content * self._randn(self.L, self.B, self.H, self.D)
        k += self._randn(self.L, self.B, self.H, self.D)
        return torch.stack([k, self._randn(self.L, self.B, self.H, self.D)])

    def advance(self) -> None:
        """One decode step of the queries' drift, and topic shifts."""
        v = self.step_spread
        s = torch.exp(v * self._randn(self.B) - v * v / 2)  # mean 1 per request
        omr = (self.one_minus_rho[:, None, :] * s[None, :, None]).clamp(max=2.0)  # [L, B, H]
        rho = (1 - omr).repeat_interleave(self.G, dim=2)[..., None]  # [L, B, Hq, 1]
        noise = unit(self._randn(*self.xi.shape))
        self.xi = unit(rho * self.xi + (1 - rho * rho).clamp_min(0).sqrt() * noise)
        fresh = self._rand(self.B) < self.shift
        other = (self.topic + 1 + self._randint(self.T - 1, self.B)) % self.T
        self.topic = torch.where(fresh, other, self.topic)
        self.xi = torch.where(fresh[None, :, None, None], unit(self._randn(*self.xi.shape)), self.xi)
        self.shifts += fresh.sum()


class ChurnProbe:
    """Per sparse layer statistics of attention and selection (module docstring); engine.probe = ChurnProbe(engine)."""

    def __init__(self, engine):
        self.e, self.k = engine, engine.cfg.select_pages
        self.active = False  # until set, calls only keep the previous step's state (slots still filling)
        self.acc: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.prev: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        # (layer, slot) -> per KV head: the pages attended at the previous step, and per victim capacity the pages
        # evicted since, least recently evicted first (dict order).
        self.attended: dict[tuple[int, int], list[set[int]]] = {}
        self.victims: dict[tuple[int, int], list[dict[float, dict[int, None]]]] = {}

    @torch.no_grad()
    def __call__(self, layer: int, plan, q: torch.Tensor, slots: torch.Tensor) -> None:
        e = self.e
        H, G, D, start = e.shape.num_kv_heads, e.shape.group, e.shape.head_dim, e.cfg.sink_pages
        for b, slot in enumerate(plan.req_slots.tolist()):
            end = min(int(plan.cand_end[b]), e.max_pages)
            if slot == e.pad_slot or end - start <= self.k:
                continue
            qb = q[b].view(H, G, D).float().clone()  # q may be a static buffer the next step overwrites
            mass = page_attention_mass(e, layer, slot, qb, end)  # [H, n]
            vals = mass.topk(min(2 * self.k, mass.shape[1]), dim=1)
            top = vals.indices[:, :self.k]
            prev = self.prev.get((layer, slot))
            self.prev[(layer, slot)] = (qb, top)
            if not self.active or prev is None:
                continue
            a = self.acc[layer]
            a["cases"] += H
            a["topk_mass"] += float(vals.values[:, :self.k].sum())
            a["top_half_k_mass"] += float(vals.values[:, :self.k // 2].sum())
            a["top_2k_mass"] += float(vals.values.sum())
            a["top1_mass"] += float(vals.values[:, 0].sum())
            sel = slots[slot].long() - start
            chosen = torch.zeros_like(mass, dtype=torch.bool)
            for h in range(H):
                chosen[h, sel[h][(sel[h] >= 0) & (sel[h] < mass.shape[1])]] = True
            a["covered_mass"] += float((mass * chosen).sum())
            now = [set(c.nonzero().flatten().tolist()) for c in chosen]
            before = self.attended.get((layer, slot))
            self._victims(a, (layer, slot), now)
            pq, ptop = prev
            kept_h = (top[:, :, None] == ptop[:, None, :]).any(-1).sum(-1)  # [H]
            a["oracle_change"] += H - float(kept_h.sum()) / self.k  # summed over heads
            cos = torch.nn.functional.cosine_similarity(qb, pq, dim=-1).mean(1)  # [H]
            for h, c in enumerate(cos.tolist()):
                i = sum(c >= edge for edge in COS_EDGES)
                a[f"cos_cases_{i}"] += 1
                a[f"cos_oracle_change_{i}"] += 1 - float(kept_h[h]) / self.k
                if before is not None:  # the previous step's attended pages, from the second measured step on
                    a[f"cos_compared_{i}"] += 1
                    a[f"cos_changed_{i}"] += len(now[h] - before[h]) / self.k
                    a[f"cos_unchanged_{i}"] += float(now[h] == before[h])
            a["cos"] += float(cos.sum())
            a["cos2"] += float((cos * cos).sum())
            a["below_tau"] += float((cos < e.tau).sum())
            a["boundary"] += H * float(cos.mean() < BOUNDARY_TAU)  # every head of the row, as LouisKV counts

    def _victims(self, a: dict[str, float], key: tuple[int, int], now: list[set[int]]) -> None:
        prev = self.attended.get(key)
        self.attended[key] = now
        if prev is None:
            self.victims[key] = [{f: {} for f in VICTIM_SIZES} for _ in now]
            return
        for h, pages in enumerate(now):
            new, gone = pages - prev[h], sorted(prev[h] - pages)
            a["new_pages"] += len(new)
            for f, cache in self.victims[key][h].items():
                a[f"victim_hits_{f:g}"] += sum(p in cache for p in new)
                for p in new:
                    cache.pop(p, None)
                for p in gone:
                    cache.pop(p, None)
                    cache[p] = None
                while len(cache) > f * self.k:
                    del cache[next(iter(cache))]

    def by_cos(self) -> list[dict[str, float]]:
        """Over every sparse layer, per bucket of the adjacent queries' group-mean cosine (COS_EDGES): the share of
        (KV head, step) cases in it, the oracle's top-k change and the selection's changed share per case (pages new
        to what the head attended at the previous step, over the budget's pages), and the share of cases whose
        selection did not change at all (these two over the cases with a previous step's selection measured)."""
        total = sum(a["cases"] for a in self.acc.values()) or 1
        out = []
        for i, lo in enumerate((-1.0, *COS_EDGES)):
            n = sum(a[f"cos_cases_{i}"] for a in self.acc.values())
            c = max(sum(a[f"cos_compared_{i}"] for a in self.acc.values()), 1)
            out.append({"cos_from": lo, "cos_to": (*COS_EDGES, 1.0)[i], "share": n / total,
                        "oracle_change": sum(a[f"cos_oracle_change_{i}"] for a in self.acc.values()) / max(n, 1),
                        "changed_share": sum(a[f"cos_changed_{i}"] for a in self.acc.values()) / c,
                        "unchanged": sum(a[f"cos_unchanged_{i}"] for a in self.acc.values()) / c})
        return out

    def per_layer(self) -> dict[int, dict[str, float]]:
        out = {}
        for layer, a in sorted(self.acc.items()):
            n = max(a["cases"], 1)
            mean = a["cos"] / n
            out[layer] = {"cases": int(a["cases"]), "topk_mass": a["topk_mass"] / n, "top1_mass": a["top1_mass"] / n,
                          "top_half_k_mass": a["top_half_k_mass"] / n, "top_2k_mass": a["top_2k_mass"] / n,
                          "boundary": a["boundary"] / n,
                          "covered_mass": a["covered_mass"] / n, "oracle_change": a["oracle_change"] / n,
                          "cos_mean": mean, "cos_std": math.sqrt(max(a["cos2"] / n - mean * mean, 0.0)),
                          "below_tau": a["below_tau"] / n}
            for f in VICTIM_SIZES:
                out[layer][f"victim_hit_{f:g}"] = a[f"victim_hits_{f:g}"] / max(a["new_pages"], 1)
        return out


def counters(engine) -> torch.Tensor:
    """Per layer [L, 3]: flagged (row, KV head) checks, and (page, KV head) chunks recalled before and after
    attention, so far. stats() sums the recall over layers and divides the flags by every check since the engine was
    built (the first steps' fill included); differences of these counters give the steady state per layer."""
    return torch.cat([engine._stat_sim[:, :1], engine._stat_recall[:, :2]], dim=1).cpu().clone()


def summarize(probe: ChurnProbe, engine, before: torch.Tensor, steps: int, rows: int) -> dict:
    """Per-layer and mean statistics over the steps since `before` (counters()): the probe's, the correction rate,
    and the share of the budget's pages that change (are recalled) per step and KV head, and of those recalled
    before attention."""
    d_now = counters(engine) - before
    k, H = engine.cfg.select_pages, engine.shape.num_kv_heads
    checks = max(steps * rows * H, 1)
    layers = probe.per_layer()
    for layer, d in layers.items():
        flagged, now, later = d_now[layer].tolist()
        d["correction_rate"] = flagged / checks
        d["changed_share"] = (now + later) / (checks * k)
        d["changed_share_now"] = now / (checks * k)
    keys = ("top_half_k_mass", "topk_mass", "top_2k_mass", "top1_mass", "covered_mass", "boundary", "oracle_change",
            "cos_mean", "cos_std", "below_tau",
            "correction_rate", "changed_share", "changed_share_now",
            *(f"victim_hit_{f:g}" for f in VICTIM_SIZES))
    mean = {key: sum(d[key] for d in layers.values()) / max(len(layers), 1) for key in keys}
    return {"mean": {key: round(v, 4) for key, v in mean.items()},
            "by_cos": [{key: round(v, 4) for key, v in b.items()} for b in probe.by_cos()],
            "per_layer": {layer: {key: round(v, 4) if isinstance(v, float) else v for key, v in d.items()}
                          for layer, d in layers.items()}}
