"""Torch references for page scoring, top-k selection and slot assignment (see docs/kernels.md)."""

from __future__ import annotations

import torch

POOLINGS = ("mean_softmax", "max")
# The engine's two selection phases: heads[b, h] True selects before attention, False after it.
PHASE_NOW, PHASE_LATER = 1, 2


def in_phase(heads: torch.Tensor | None, phase: int) -> torch.Tensor | None:
    """[B, H] bool: the heads that select in `phase` (None: every head)."""
    if phase not in (PHASE_NOW, PHASE_LATER):
        raise ValueError(f"phase must be {PHASE_NOW} (now) or {PHASE_LATER} (later), got {phase!r}")
    return None if heads is None else heads == (phase == PHASE_NOW)


def naive_score_pages(
    q: torch.Tensor,
    summaries: torch.Tensor,
    page_table: torch.Tensor,
    req_slots: torch.Tensor,
    cand_start: int,
    cand_end: torch.Tensor,
    scale: float,
    pooling: str = "mean_softmax",
    heads: torch.Tensor | None = None,
    phase: int = PHASE_NOW,
    q_by_slot: bool = False,
) -> torch.Tensor:
    """Rows of the heads that do not select in `phase` are left unwritten (NaN here)."""
    if pooling not in POOLINGS:
        raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
    mine = in_phase(heads, phase)
    B, H = req_slots.shape[0], summaries.shape[1]
    G = q.shape[1] // H
    M = page_table.shape[1]
    scores = torch.full((B, H, M), float("nan"), dtype=torch.float32, device=q.device)
    for b, slot in enumerate(req_slots.tolist()):
        qb = q[slot if q_by_slot else b]
        end = min(int(cand_end[b]), M)
        for h in range(H):
            if mine is not None and not mine[b, h]:
                continue
            scores[b, h] = float("-inf")
            if end <= cand_start:
                continue
            pages = page_table[slot, cand_start:end].long()
            kmin = summaries[pages, h, 0].float()  # [n, D]
            kmax = summaries[pages, h, 1].float()
            qh = qb[h * G:(h + 1) * G].float()[:, None]  # [G, 1, D]
            s = scale * torch.maximum(qh * kmin, qh * kmax).sum(-1)  # [G, n]
            pooled = s.amax(dim=0) if pooling == "max" else torch.softmax(s, dim=-1).mean(dim=0)
            scores[b, h, cand_start:end] = pooled
    return scores


def naive_select_pages(scores: torch.Tensor, k: int) -> torch.Tensor:
    # A stable descending sort breaks ties by the lower page id.
    vals, idx = torch.sort(scores, dim=-1, descending=True, stable=True)
    sel = torch.full((*scores.shape[:-1], k), -1, dtype=torch.int32, device=scores.device)
    n = min(k, scores.shape[-1])
    sel[..., :n] = torch.where(vals[..., :n] == float("-inf"), -1, idx[..., :n]).to(torch.int32)
    return sel


def naive_slot_delta(old: torch.Tensor, sel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    B, H, k = old.shape
    new = torch.full_like(old, -1)
    for b in range(B):
        for h in range(H):
            o, s = old[b, h].tolist(), sel[b, h].tolist()
            wanted = {p for p in s if p != -1}
            kept = [p if p in wanted else -1 for p in o]
            incoming = iter([p for p in s if p != -1 and p not in kept])
            row = [p if p != -1 else next(incoming, -1) for p in kept]
            new[b, h] = torch.tensor(row, dtype=old.dtype)
    changed = (new != -1) & (new != old)
    return new, changed
