"""Triton page scoring and slot assignment; top-k selection through torch.topk (graph-safe)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._alloc import empty
from .._utils import check_device, interpret_mode
from .naive import POOLINGS


@triton.jit
def _page_logits_kernel(
    q_ptr, summ_ptr, pt_ptr, slots_ptr, cend_ptr, out_ptr,
    cand_start, M, scale,
    sq_b, sq_h, sq_d,
    ss_p, ss_h, ss_mm, ss_d,
    spt_r, spt_m,
    s_slot, s_cend,
    so_b, so_h, so_m,
    G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLOCK_PAGES: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Raw scaled logits of the G query heads of KV head h over a block of candidate pages.

    Writes out[b, h*G+g, j] for candidate pages j only; the pooling kernel never reads the rest.
    """
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    j0 = tl.program_id(2) * BLOCK_PAGES
    end = tl.minimum(tl.load(cend_ptr + b * s_cend), M)
    # Blocks without candidates skip all loads; this is most of the grid for short rows.
    if (j0 < end) & (j0 + BLOCK_PAGES > cand_start):
        slot = tl.load(slots_ptr + b * s_slot).to(tl.int64)
        g = tl.arange(0, GP)
        d = tl.arange(0, D)
        j = j0 + tl.arange(0, BLOCK_PAGES)
        is_cand = (j >= cand_start) & (j < end)
        hq = h * G + g
        q = tl.load(q_ptr + b * sq_b + hq[:, None] * sq_h + d[None, :] * sq_d, mask=(g < G)[:, None], other=0.0)
        page = tl.load(pt_ptr + slot * spt_r + j.to(tl.int64) * spt_m, mask=is_cand, other=0).to(tl.int64)
        rows = summ_ptr + page[:, None] * ss_p + h * ss_h + d[None, :].to(tl.int64) * ss_d
        kmin = tl.load(rows, mask=is_cand[:, None], other=0.0)
        kmax = tl.load(rows + ss_mm, mask=is_cand[:, None], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
            kmin = kmin.to(tl.float32)
            kmax = kmax.to(tl.float32)
        # max(q*a, q*b) = relu(q)*max(a,b) + min(q,0)*min(a,b) termwise: two dots with exact products.
        # "ieee" only affects fp32 operands (no tf32 rounding); bf16/fp16 still run on tensor cores.
        lo = tl.minimum(kmin, kmax)
        hi = tl.maximum(kmin, kmax)
        zero = tl.zeros_like(q)
        s = tl.dot(tl.maximum(q, zero), tl.trans(hi), input_precision="ieee")
        s = tl.dot(tl.minimum(q, zero), tl.trans(lo), acc=s, input_precision="ieee")
        out = out_ptr + b * so_b + hq[:, None] * so_h + j[None, :].to(tl.int64) * so_m
        tl.store(out, s * scale, mask=(g < G)[:, None] & is_cand[None, :])


@triton.jit
def _pool_scores_kernel(
    logits_ptr, cend_ptr, scores_ptr,
    cand_start, M,
    sl_b, sl_h, sl_m,
    s_cend,
    so_b, so_h, so_m,
    G: tl.constexpr, GP: tl.constexpr, BLOCK_M: tl.constexpr, POOL_MAX: tl.constexpr,
):
    """scores[b, h, :] from the candidate logits of the G query heads of h; -inf outside the candidates."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    end = tl.minimum(tl.load(cend_ptr + b * s_cend), M)
    g = tl.arange(0, GP)
    g_ok = g < G
    rows = logits_ptr + b * sl_b + (h * G + g)[:, None] * sl_h
    neg_inf = float("-inf")
    if not POOL_MAX:
        # Online softmax statistics per query head over the candidates only.
        m_i = tl.full([GP], neg_inf, tl.float32)
        l_i = tl.zeros([GP], tl.float32)
        for start in range(cand_start, end, BLOCK_M):
            j = start + tl.arange(0, BLOCK_M)
            s = tl.load(rows + j[None, :].to(tl.int64) * sl_m, mask=g_ok[:, None] & (j < end)[None, :], other=neg_inf)
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == neg_inf, 0.0, m_new)
            l_i = l_i * tl.exp(m_i - m_safe) + tl.sum(tl.exp(s - m_safe[:, None]), axis=1)
            m_i = m_new
        m_safe = tl.where(m_i == neg_inf, 0.0, m_i)
        # l >= 1 for a head with candidates (its max term is exp(0)); otherwise l == 0 and every term is 0 anyway.
        inv_l = 1.0 / tl.maximum(l_i, 1.0)
    for start in range(0, M, BLOCK_M):
        j = start + tl.arange(0, BLOCK_M)
        is_cand = (j >= cand_start) & (j < end)
        s = tl.load(rows + j[None, :].to(tl.int64) * sl_m, mask=g_ok[:, None] & is_cand[None, :], other=neg_inf)
        if POOL_MAX:
            pooled = tl.max(s, axis=0)
        else:
            pooled = tl.sum(tl.exp(s - m_safe[:, None]) * inv_l[:, None], axis=0) / G
        out = scores_ptr + b * so_b + h * so_h + j.to(tl.int64) * so_m
        tl.store(out, tl.where(is_cand, pooled, neg_inf), mask=j < M)


def score_pages(
    q: torch.Tensor,
    summaries: torch.Tensor,
    page_table: torch.Tensor,
    req_slots: torch.Tensor,
    cand_start: int,
    cand_end: torch.Tensor,
    scale: float,
    pooling: str = "mean_softmax",
) -> torch.Tensor:
    if pooling not in POOLINGS:
        raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
    check_device(q, summaries, page_table, req_slots, cand_end)
    B, Hq, D = q.shape
    H = summaries.shape[1]
    G = Hq // H
    M = page_table.shape[1]
    assert Hq == H * G and summaries.shape[2:] == (2, D) and D >= 16 and D & (D - 1) == 0
    # tl.dot needs at least 16 rows and 16 columns: the G heads are padded to 16, pages come in blocks >= 16.
    GP = triton.next_power_of_2(G)
    block_pages = max(16, min(64, triton.next_power_of_2(M)))
    # Scratch: only candidate entries are written (and read); poisoned like an output in tests.
    logits = empty(B, Hq, M, dtype=torch.float32, device=q.device)
    scores = empty(B, H, M, dtype=torch.float32, device=q.device)
    _page_logits_kernel[(B, H, triton.cdiv(M, block_pages))](
        q, summaries, page_table, req_slots, cand_end, logits,
        cand_start, M, scale,
        *q.stride(), *summaries.stride(), *page_table.stride(), req_slots.stride(0), cand_end.stride(0),
        *logits.stride(),
        G=G, GP=max(16, GP), D=D, BLOCK_PAGES=block_pages,
        # The interpreter's dot mishandles bf16 operands; upcasting there is exact.
        UPCAST=interpret_mode(),
        num_warps=4,
    )
    _pool_scores_kernel[(B, H)](
        logits, cand_end, scores,
        cand_start, M,
        *logits.stride(), cand_end.stride(0), *scores.stride(),
        G=G, GP=GP, BLOCK_M=max(16, min(1024 // GP, triton.next_power_of_2(M))), POOL_MAX=pooling == "max",
        num_warps=4,
    )
    return scores


def select_pages(scores: torch.Tensor, k: int) -> torch.Tensor:
    n = min(k, scores.shape[-1])
    vals, idx = torch.topk(scores, n, dim=-1)
    sel = torch.where(vals == float("-inf"), -1, idx).to(torch.int32)
    if n < k:  # fewer pages than slots: the rest stay empty
        sel = torch.nn.functional.pad(sel, (0, k - n), value=-1)
    return sel


@triton.jit
def _slot_delta_kernel(
    old_ptr, sel_ptr, new_ptr, changed_ptr,
    so_b, so_h, so_k,
    ss_b, ss_h, ss_k,
    sn_b, sn_h, sn_k,
    sc_b, sc_h, sc_k,
    K: tl.constexpr, KP: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    i = tl.arange(0, KP)
    ok = i < K
    i64 = i.to(tl.int64)
    old = tl.load(old_ptr + b * so_b + h * so_h + i64 * so_k, mask=ok, other=-1)
    sel = tl.load(sel_ptr + b * ss_b + h * ss_h + i64 * ss_k, mask=ok, other=-1)
    # eq[s, t]: slot s already holds selected page t (padding lanes are -1 and never match).
    eq = (old[:, None] == sel[None, :]) & (sel != -1)[None, :]
    resident = tl.max(eq.to(tl.int32), axis=1) > 0  # per slot
    incoming = (sel != -1) & (tl.max(eq.to(tl.int32), axis=0) == 0)  # per selected page
    free = ok & ~resident
    # The r-th incoming page (in sel order) goes to the r-th free slot (in slot order).
    in_rank = tl.cumsum(incoming.to(tl.int32), axis=0) - 1
    free_rank = tl.cumsum(free.to(tl.int32), axis=0) - 1
    match = free[:, None] & incoming[None, :] & (free_rank[:, None] == in_rank[None, :])
    filled = tl.max(match.to(tl.int32), axis=1) > 0
    placed = tl.sum(tl.where(match, sel[None, :], 0), axis=1)
    new = tl.where(resident, old, tl.where(filled, placed, -1))
    tl.store(new_ptr + b * sn_b + h * sn_h + i64 * sn_k, new, mask=ok)
    tl.store(changed_ptr + b * sc_b + h * sc_h + i64 * sc_k, (new != -1) & (new != old), mask=ok)


def slot_delta(old: torch.Tensor, sel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    check_device(old, sel)
    B, H, K = old.shape
    assert sel.shape == old.shape
    new = empty(B, H, K, dtype=torch.int32, device=old.device)
    changed = empty(B, H, K, dtype=torch.bool, device=old.device)
    KP = triton.next_power_of_2(K)
    _slot_delta_kernel[(B, H)](
        old, sel, new, changed,
        *old.stride(), *sel.stride(), *new.stride(), *changed.stride(),
        K=K, KP=KP, num_warps=8 if KP >= 128 else 4,
    )
    return new, changed
