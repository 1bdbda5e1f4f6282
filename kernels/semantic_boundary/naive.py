"""Torch reference for semantic_boundary (see docs/kernels.md)."""

from __future__ import annotations

import torch

EPS = 1e-12


def naive_semantic_boundary(
    q: torch.Tensor,
    prev_q: torch.Tensor,
    req_slots: torch.Tensor,
    has_prev: torch.Tensor,
    tau: float,
    lens: torch.Tensor,
    page_size: int,
    marks: torch.Tensor,
    slots: torch.Tensor,
    n_slots: torch.Tensor,
    heads: torch.Tensor,
    stats: torch.Tensor | None = None,
    pad_slot: int = -1,
) -> torch.Tensor:
    """Row b (request r = req_slots[b]) is at a boundary when r has no previous query, tau >= 1, or tau > 0 and the
    mean over all Hq heads of cos(q[b], prev_q[r]) < tau (LouisKV's r_t). Writes heads[b, h] = boundary or head h
    of r holds fewer pages than n_slots[b]; marks[r, (lens[b] - 1) // page_size] |= boundary for real rows; then
    prev_q[r] = q[b], has_prev[r] = True. stats ([3] float64), real rows: += H per boundary row, the sum of r_t over
    rows with a previous query, and their count. Returns the boundary flags [B] bool."""
    slot = req_slots.long()
    prev = prev_q[slot].float()
    qf = q.float()
    cos = (qf * prev).sum(-1) / (qf.norm(dim=-1) * prev.norm(dim=-1)).clamp_min(EPS)  # [B, Hq]
    r_t = cos.mean(-1)
    had = has_prev[slot]
    fired = (r_t < tau) & (tau > 0) | (tau >= 1) | ~had
    held = (slots[slot] >= 0).sum(-1)  # [B, H]
    heads.copy_(fired[:, None] | (held < n_slots[:, None]))
    real = req_slots != pad_slot
    page = (lens.long() - 1) // page_size
    for b in torch.nonzero(real & fired).flatten().tolist():
        marks[slot[b], page[b]] = 1
    if stats is not None:
        counted = real & had
        stats[0] += (fired & real).sum() * heads.shape[1]
        stats[1] += (r_t.double() * counted).sum()
        stats[2] += counted.sum()
    prev_q[slot] = q.to(prev_q.dtype)
    has_prev[slot] = True
    return fired
