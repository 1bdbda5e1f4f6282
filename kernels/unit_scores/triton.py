"""Triton unit_page_scores: one program per (row, KV head) streams the request's unit centroids twice (the group's
softmax normaliser, then each unit's group-mean probability into a scratch row) and takes each candidate page's
best unit from the scratch."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._alloc import empty
from .._utils import check_device, check_index_vectors
from ..page_select.naive import PHASE_NOW, check_phase

UNITS = 16  # centroids per block
PAGES = 16  # candidate pages per block of the page pass


@triton.jit
def _unit_page_scores_kernel(
    q_ptr, cent_ptr, count_ptr, range_ptr, table_ptr, slots_ptr, end_ptr, heads_ptr, scratch_ptr, out_ptr,
    cand_start, M, scale, phase_now,
    sq_b, sq_h, sq_d,
    sc_u, sc_h, sc_d,
    sn_u, sn_h,
    sr_p, sr_h, sr_i,
    st_r, st_m,
    sh_b, sh_h,
    ss_b, ss_h, ss_u,
    so_b, so_h, so_m,
    G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, UPP: tl.constexpr, RP: tl.constexpr,
    BLOCK_U: tl.constexpr, BLOCK_P: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    if tl.load(heads_ptr + b * sh_b + h * sh_h).to(tl.int32) != phase_now:
        return
    slot = tl.load(slots_ptr + b).to(tl.int64)
    end = tl.minimum(tl.load(end_ptr + b), M)
    n_units = tl.maximum(end - cand_start, 0) * UPP
    g = tl.arange(0, GP)
    d = tl.arange(0, D)
    q = tl.load(q_ptr + b * sq_b + (h * G + g).to(tl.int64)[:, None] * sq_h + d[None, :] * sq_d,
                mask=(g < G)[:, None], other=0.0).to(tl.float32)
    m = tl.full([GP], float("-inf"), tl.float32)
    s = tl.zeros([GP], tl.float32)
    # Pass 1: per query head the running max and sum of exp over the non-empty units.
    for u0 in range(0, n_units, BLOCK_U):
        u = u0 + tl.arange(0, BLOCK_U)
        ok = u < n_units
        hp = tl.load(table_ptr + slot * st_r + (cand_start + u // UPP).to(tl.int64) * st_m, mask=ok, other=0)
        row = hp.to(tl.int64) * UPP + u % UPP
        ok = ok & (tl.load(count_ptr + row * sn_u + h * sn_h, mask=ok, other=0) > 0)
        c = tl.load(cent_ptr + row[:, None] * sc_u + h * sc_h + d[None, :] * sc_d, mask=ok[:, None],
                    other=0.0).to(tl.float32)
        logit = scale * tl.sum(q[:, None, :] * c[None, :, :], axis=2)  # [GP, BLOCK_U]
        logit = tl.where(ok[None, :], logit, float("-inf"))
        m_new = tl.maximum(m, tl.max(logit, axis=1))
        alive = m_new > float("-inf")
        s = tl.where(alive, s * tl.exp(m - m_new) + tl.sum(tl.exp(logit - m_new[:, None]), axis=1), s)
        m = m_new
    # Pass 2: A[u] = mean over the group of the softmax, into this (row, head)'s scratch row.
    inv = tl.where((g < G) & (s > 0), 1.0 / tl.where(s > 0, s, 1.0), 0.0)
    for u0 in range(0, n_units, BLOCK_U):
        u = u0 + tl.arange(0, BLOCK_U)
        ok = u < n_units
        hp = tl.load(table_ptr + slot * st_r + (cand_start + u // UPP).to(tl.int64) * st_m, mask=ok, other=0)
        row = hp.to(tl.int64) * UPP + u % UPP
        full = ok & (tl.load(count_ptr + row * sn_u + h * sn_h, mask=ok, other=0) > 0)
        c = tl.load(cent_ptr + row[:, None] * sc_u + h * sc_h + d[None, :] * sc_d, mask=full[:, None],
                    other=0.0).to(tl.float32)
        logit = scale * tl.sum(q[:, None, :] * c[None, :, :], axis=2)
        p = tl.where(full[None, :], tl.exp(logit - m[:, None]) * inv[:, None], 0.0)
        a = tl.where(full, tl.sum(p, axis=0) / G, float("-inf"))
        tl.store(scratch_ptr + b * ss_b + h * ss_h + u.to(tl.int64) * ss_u, a, mask=ok)
    tl.debug_barrier()  # the scratch row is read back by other threads of this program
    # Pass 3: page j's score is the best A among its units (at most RP of them: a page of RP tokens).
    r = tl.arange(0, RP)
    for j0 in range(0, M, BLOCK_P):
        j = j0 + tl.arange(0, BLOCK_P)
        cand = (j >= cand_start) & (j < end)
        hp = tl.load(table_ptr + slot * st_r + j.to(tl.int64) * st_m, mask=cand, other=0).to(tl.int64)
        first = tl.load(range_ptr + hp * sr_p + h * sr_h, mask=cand, other=0)
        last = tl.load(range_ptr + hp * sr_p + h * sr_h + sr_i, mask=cand, other=-1)
        u = first[:, None] + r[None, :]
        a = tl.load(scratch_ptr + b * ss_b + h * ss_h + u.to(tl.int64) * ss_u, mask=cand[:, None] & (u <= last[:, None]),
                    other=float("-inf"))
        tl.store(out_ptr + b * so_b + h * so_h + j.to(tl.int64) * so_m, tl.max(a, axis=1), mask=j < M)


def unit_page_scores(
    q: torch.Tensor,
    centroids: torch.Tensor,
    counts: torch.Tensor,
    ranges: torch.Tensor,
    page_table: torch.Tensor,
    req_slots: torch.Tensor,
    cand_start: int,
    cand_end: torch.Tensor,
    scale: float,
    page_size: int,
    heads: torch.Tensor,
    phase: int = PHASE_NOW,
    scratch: torch.Tensor | None = None,
) -> torch.Tensor:
    """See naive_unit_page_scores. scratch: float32 [>= B, H, >= M * upp], one row per (row, head) for the units'
    probabilities (allocated here when None; the engine passes a persistent one)."""
    check_phase(phase)
    check_device(q, centroids, counts, ranges, page_table, req_slots, cand_end, heads)
    check_index_vectors(req_slots=req_slots, cand_end=cand_end)
    B, Hq, D = q.shape
    P, H = ranges.shape[:2]
    M = page_table.shape[1]
    upp = centroids.shape[0] // P
    assert centroids.shape == (P * upp, H, D) and counts.shape == (P * upp, H) and ranges.shape == (P, H, 2)
    assert Hq % H == 0 and heads.shape == (B, H) and heads.dtype == torch.bool and D & (D - 1) == 0
    assert page_size % upp == 0 and page_size & (page_size - 1) == 0
    if scratch is None:
        scratch = empty(B, H, M * upp, dtype=torch.float32, device=q.device)
    assert scratch.shape[0] >= B and scratch.shape[1] == H and scratch.shape[2] >= M * upp
    out = empty(B, H, M, dtype=torch.float32, device=q.device)
    G = Hq // H
    _unit_page_scores_kernel[(B, H)](
        q, centroids, counts, ranges, page_table, req_slots, cand_end, heads, scratch, out,
        cand_start, M, float(scale), int(phase == PHASE_NOW),
        *q.stride(), *centroids.stride(), *counts.stride(), *ranges.stride(), *page_table.stride(), *heads.stride(),
        *scratch.stride(), *out.stride(),
        G=G, GP=triton.next_power_of_2(G), D=D, UPP=upp, RP=page_size, BLOCK_U=UNITS, BLOCK_P=PAGES,
    )
    return out
