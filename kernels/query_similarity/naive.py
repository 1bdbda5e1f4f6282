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
) -> torch.Tensor:
    B, Hq, D = q.shape
    slots = req_slots.long()
    prev = prev_q[slots].float()  # a copy: read before the rows are overwritten below
    qf = q.float()
    cos = (qf * prev).sum(-1) / (qf.norm(dim=-1) * prev.norm(dim=-1)).clamp_min(EPS)  # [B, Hq]
    mean = cos.view(B, Hq // group, group).mean(-1)
    flags = (mean < tau) & (tau > 0) | (tau >= 1) | ~has_prev[slots][:, None]
    prev_q[slots] = q.to(prev_q.dtype)
    has_prev[slots] = True
    return flags
