"""Torch reference for query_similarity (see docs/kernels.md)."""

from __future__ import annotations

import torch

EPS = 1e-12


def naive_query_similarity(
    q: torch.Tensor,
    prev_q: torch.Tensor,
    req_slots: torch.Tensor,
    has_prev: torch.Tensor,
    tau: float,
    group: int,
    stats: torch.Tensor | None = None,
    pad_slot: int = -1,
    slots: torch.Tensor | None = None,
    n_slots: torch.Tensor | None = None,
    heads: torch.Tensor | None = None,
) -> torch.Tensor:
    """stats, when given ([3] float64), accumulates over rows whose slot is not pad_slot: flagged KV heads,
    the sum of the group-mean cosines of rows that had a previous query, and how many such (row, head).
    slots ([R, H, k] int32, a layer's slot table), n_slots ([B] int32) and heads ([B, H] bool, written) go
    together: heads[b, h] = flags[b, h] or head h of request req_slots[b] holds fewer pages than n_slots[b]."""
    B, Hq, D = q.shape
    slots_idx = req_slots.long()
    prev = prev_q[slots_idx].float()  # a copy: read before the rows are overwritten below
    qf = q.float()
    cos = (qf * prev).sum(-1) / (qf.norm(dim=-1) * prev.norm(dim=-1)).clamp_min(EPS)  # [B, Hq]
    mean = cos.view(B, Hq // group, group).mean(-1)
    had = has_prev[slots_idx]
    flags = (mean < tau) & (tau > 0) | (tau >= 1) | ~had[:, None]
    if stats is not None:
        real = (req_slots != pad_slot)[:, None]
        counted = real & had[:, None]
        stats[0] += (flags & real).sum()
        stats[1] += (mean.double() * counted).sum()
        stats[2] += counted.sum() * mean.shape[1]
    if heads is not None:
        held = (slots[slots_idx] >= 0).sum(-1)  # [B, H] pages each head holds
        heads.copy_(flags | (held < n_slots[:, None]))
    prev_q[slots_idx] = q.to(prev_q.dtype)
    has_prev[slots_idx] = True
    return flags
