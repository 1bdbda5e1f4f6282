"""Triton semantic_boundary: LouisKV's per-row trigger fused with the heads that select, the boundary mark of the
row's newest page and the prev_q update (one launch per layer)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._alloc import empty
from .._utils import check_device, check_index_vectors
from .naive import EPS


@triton.jit
def _semantic_boundary_kernel(
    q_ptr, prev_ptr, slots_ptr, has_prev_ptr, lens_ptr, marks_ptr, table_ptr, nslots_ptr, heads_ptr, fired_ptr,
    stats_ptr, tau, Hq, H, K, M, pad_slot, page_size,
    sq_b, sq_h, sq_d,
    sp_r, sp_h, sp_d,
    sm_r, sm_m,
    st_r, st_h, st_k,
    sh_b, sh_h,
    HQP: tl.constexpr, HP: tl.constexpr, KP: tl.constexpr, D: tl.constexpr, EPS: tl.constexpr, STATS: tl.constexpr,
):
    """One program per batch row: the row's Hq query heads as [HQP, D]."""
    b = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    hq = tl.arange(0, HQP)
    d = tl.arange(0, D)
    mask = (hq < Hq)[:, None]
    q_ptrs = q_ptr + b * sq_b + hq.to(tl.int64)[:, None] * sq_h + d[None, :] * sq_d
    p_ptrs = prev_ptr + slot * sp_r + hq.to(tl.int64)[:, None] * sp_h + d[None, :] * sp_d
    q = tl.load(q_ptrs, mask=mask, other=0.0)
    prev = tl.load(p_ptrs, mask=mask, other=0.0).to(tl.float32)
    has = tl.load(has_prev_ptr + slot)
    qf = q.to(tl.float32)
    dot = tl.sum(qf * prev, axis=1)
    norms = tl.sqrt(tl.sum(qf * qf, axis=1)) * tl.sqrt(tl.sum(prev * prev, axis=1))
    r_t = tl.sum(dot / tl.maximum(norms, EPS), axis=0) / Hq  # padded heads have dot == 0
    fired = ((r_t < tau) & (tau > 0)) | (tau >= 1) | (has == 0)
    tl.store(fired_ptr + b, fired)
    h = tl.arange(0, HP)
    i = tl.arange(0, KP)
    held = tl.load(table_ptr + slot * st_r + h.to(tl.int64)[:, None] * st_h + i[None, :].to(tl.int64) * st_k,
                   mask=(h < H)[:, None] & (i < K)[None, :], other=-1)
    short = tl.sum((held >= 0).to(tl.int32), axis=1) < tl.load(nslots_ptr + b)
    tl.store(heads_ptr + b * sh_b + h.to(tl.int64) * sh_h, (short.to(tl.int32) + fired.to(tl.int32)) > 0, mask=h < H)
    if slot != pad_slot:
        if fired:
            page = ((tl.load(lens_ptr + b) - 1) // page_size).to(tl.int64)
            tl.store(marks_ptr + slot * sm_r + page * sm_m, 1, mask=page < M)
        if STATS:
            tl.atomic_add(stats_ptr, fired.to(tl.float64) * tl.sum((h < H).to(tl.float64)))
            if has != 0:
                tl.atomic_add(stats_ptr + 1, r_t.to(tl.float64))
                tl.atomic_add(stats_ptr + 2, tl.sum((h == 0).to(tl.float64)))  # 1.0 (see query_similarity)
    # Other threads of this program may still be reading prev_q elements that the stores below overwrite.
    tl.debug_barrier()
    tl.store(p_ptrs, q.to(prev_ptr.dtype.element_ty), mask=mask)
    tl.store(has_prev_ptr + slot, 1)


def semantic_boundary(
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
    check_device(q, prev_q, req_slots, has_prev, lens, marks, slots, n_slots, heads)
    check_index_vectors(req_slots=req_slots, has_prev=has_prev, lens=lens, n_slots=n_slots)
    if stats is not None:
        assert stats.shape == (3,) and stats.dtype == torch.float64 and stats.is_contiguous()
    B, Hq, D = q.shape
    H, K = slots.shape[1], slots.shape[2]
    assert prev_q.shape[1:] == (Hq, D) and D & (D - 1) == 0 and Hq % H == 0
    assert heads.shape == (B, H) and heads.dtype == torch.bool and marks.dim() == 2 and marks.dtype == torch.int8
    assert lens.shape == (B,) and n_slots.shape == (B,)
    fired = empty(B, dtype=torch.bool, device=q.device)
    _semantic_boundary_kernel[(B,)](
        q, prev_q, req_slots, has_prev, lens, marks, slots, n_slots, heads, fired,
        fired if stats is None else stats, float(tau), Hq, H, K, marks.shape[1], pad_slot, page_size,
        *q.stride(), *prev_q.stride(), *marks.stride(), *slots.stride(), *heads.stride(),
        HQP=triton.next_power_of_2(Hq), HP=triton.next_power_of_2(H), KP=triton.next_power_of_2(K), D=D, EPS=EPS,
        STATS=stats is not None, num_warps=8 if Hq * D > 4096 else 4,
    )
    return fired
