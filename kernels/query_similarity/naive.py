"""Torch reference for query_similarity (see docs/kernels.md)."""

from __future__ import annotations

import torch
from freekv_kernels.kv_write.naive import naive_write_kv
from freekv_kernels.page_rerank.naive import PER_BYTE, naive_sketch_picks

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
    picks: tuple[torch.Tensor, torch.Tensor] | None = None,
    pick_scale: float = 1.0,
    kv: tuple[torch.Tensor, ...] | None = None,
    replay: tuple[torch.Tensor, float] | None = None,
    early: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Flags [B, H]: the KV heads whose group-mean cosine similarity of q and the slot's previous query is below
    tau (every head at tau >= 1, none at tau <= 0 unless the slot has no previous query); q becomes the previous
    query. stats, when given ([3] float64), accumulates over rows whose slot is not pad_slot: flagged KV heads,
    the sum of the group-mean cosines of rows that had a previous query, and how many such (row, head).
    slots ([R, H, k] int32, a layer's slot table), n_slots ([B] int32) and heads ([B, H] bool, written) go
    together: heads[b, h] = flags[b, h] or head h of request req_slots[b] holds fewer pages than n_slots[b].
    picks: (sel [R, H, NB] int32, qp [R, H, 4 NB, GP] fp32) receive naive_sketch_picks(q, group, NB, pick_scale)
    at rows req_slots. kv: (k, v, k_cache, v_cache, loc), the step's naive_write_kv, done in the same launch.
    replay: (u [B, H] float32 uniform draws, rate), benchmarks only: a head is flagged where u < rate (or its slot
    has no previous query) instead of by tau; the cosines are still computed and counted.
    early: q is a prediction of the query, made one layer early (FreeKVEngine.anticipate): a head is flagged only where
    its slot has a previous query and is not pad_slot, only flagged heads' previous queries become q, has_prev is left
    as it is, and stats ([1] float64) accumulates the flagged heads; slots, heads, picks and kv are not taken.
    out ([B, H] bool): the flags are written there and returned."""
    B, Hq, D = q.shape
    slots_idx = req_slots.long()
    prev = prev_q[slots_idx].float()  # a copy: read before the rows are overwritten below
    qf = q.float()
    cos = (qf * prev).sum(-1) / (qf.norm(dim=-1) * prev.norm(dim=-1)).clamp_min(EPS)  # [B, Hq]
    mean = cos.view(B, Hq // group, group).mean(-1)
    had = has_prev[slots_idx]
    turned = (mean < tau) & (tau > 0) | (tau >= 1) if replay is None else replay[0] < replay[1]
    if early:
        assert slots is None and heads is None and picks is None and kv is None, "early takes none of these"
        flags = turned & (had & (req_slots != pad_slot))[:, None]
        if stats is not None:
            stats[0] += flags.sum()
        prev_q[slots_idx] = torch.where(flags.repeat_interleave(group, dim=1)[..., None], q.to(prev_q.dtype),
                                        prev_q[slots_idx])
        return flags if out is None else out.copy_(flags)
    flags = turned | ~had[:, None]
    if stats is not None:
        real = (req_slots != pad_slot)[:, None]
        counted = real & had[:, None]
        stats[0] += (flags & real).sum()
        stats[1] += (mean.double() * counted).sum()
        stats[2] += counted.sum() * mean.shape[1]
    if heads is not None:
        held = (slots[slots_idx] >= 0).sum(-1)  # [B, H] pages each head holds
        heads.copy_(flags | (held < n_slots[:, None]))
    if picks is not None:  # the sketch's, by request slot: one computation for both selection phases
        sel, qp = naive_sketch_picks(q, group, picks[0].shape[2], pick_scale)
        picks[0][slots_idx] = sel
        picks[1][slots_idx] = qp
    prev_q[slots_idx] = q.to(prev_q.dtype)
    has_prev[slots_idx] = True
    if kv is not None:
        naive_write_kv(*kv)
    return flags if out is None else out.copy_(flags)
