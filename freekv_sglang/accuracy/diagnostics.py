"""Selection diagnostics: how much of what the model attends to the selected pages hold.

An engine probe, called right after each sparse layer's attention, compares the pages that attention read (the
slot table at that moment) with the true group-mean attention mass of the step's query over the request's
candidate pages (the offloaded pages between sink and window, exact keys from the host arena). Per (layer, KV
head, row) it counts a hit when the highest-mass candidate page was selected, and the mass the selection covers
(normalised over the candidates). Eager only: it reads host memory every layer. The counts stay on the device, so a
layer costs one host read of the candidate ranges, not a few per row and head.
"""

from __future__ import annotations

import torch

from ..selectors import page_attention_mass


class SelectionProbe:
    def __init__(self, engine):
        self.engine = engine
        self.cases = 0
        self._hits = torch.zeros((), dtype=torch.int64, device=engine.device)
        self._mass = torch.zeros((), dtype=torch.float64, device=engine.device)

    def __call__(self, layer: int, plan, q: torch.Tensor, slots: torch.Tensor) -> None:
        e = self.engine
        H, G, D, start = e.shape.num_kv_heads, e.shape.group, e.shape.head_dim, e.cfg.sink_pages
        ends = plan.cand_end.tolist()
        for b, slot in enumerate(plan.req_slots.tolist()):
            end = min(int(ends[b]), e.max_pages)
            if slot == e.pad_slot or end <= start:
                continue
            mass = page_attention_mass(e, layer, slot, q[b].view(H, G, D), end)  # [H, n]
            n = mass.shape[1]
            sel = slots[slot].long() - start  # [H, k] candidate index, negative or past n: not a candidate
            ok = (sel >= 0) & (sel < n)
            # Counted, not assigned: an entry that is not a candidate adds 0 at a clamped index another one may hold.
            chosen = torch.zeros_like(mass, dtype=torch.int32).scatter_add_(1, sel.clamp(0, n - 1), ok.int()) > 0
            self.cases += H
            self._hits += chosen.gather(1, mass.argmax(1, keepdim=True)).sum()
            self._mass += (mass * chosen).sum().double()

    @property
    def hits(self) -> int:
        return int(self._hits)

    @property
    def mass(self) -> float:
        return float(self._mass)

    def record(self) -> dict:
        n = max(self.cases, 1)
        return {"diag_cases": self.cases, "hit_rate": self.hits / n, "mass_covered": self.mass / n}


class SelectionProbes:
    """One SelectionProbe per engine of a FreeKVModel (two with FastKV's prefill), installed on them; one record."""

    def __init__(self, engines):
        self.probes = [SelectionProbe(e) for e in engines]
        for e, p in zip(engines, self.probes):
            e.probe = p

    def record(self) -> dict:
        cases = sum(p.cases for p in self.probes)
        n = max(cases, 1)
        return {"diag_cases": cases, "hit_rate": sum(p.hits for p in self.probes) / n,
                "mass_covered": sum(p.mass for p in self.probes) / n}
