"""Triton unit_page_scores in two launches, each spread over the units or the pages (a boundary at 128K scores ~8K
units per KV head: one program per (row, KV head) walked them serially, ~3.5 ms per layer on an H100):
_unit_partials_kernel gives each chunk of a request's units its own program, which writes the chunk's per-query-head
softmax max and sum; _unit_pages_kernel gives each block of candidate pages a program, which merges the chunks'
partials into the normaliser and scores its pages' units directly from their centroids (a page's units are few)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._alloc import empty
from .._utils import check_device, check_index_vectors
from ..page_select.naive import PHASE_NOW, check_phase

UNITS = 16  # centroids per block
CHUNK = 128  # units per program of the partials (a multiple of UNITS)
PAGES = 16  # candidate pages per program of the page scores


@triton.jit
def _unit_logits(q, cent_ptr, count_ptr, table_ptr, slot, u, ok, h, cand_start,
                 sc_u, sc_h, sc_d, sn_u, sn_h, st_r, st_m, scale,
                 D: tl.constexpr, UPP: tl.constexpr):
    """Logits [GP, len(u)] of the query heads against units u of this row (-inf where not ok or the unit is empty),
    and which of them are live."""
    d = tl.arange(0, D)
    hp = tl.load(table_ptr + slot * st_r + (cand_start + u // UPP).to(tl.int64) * st_m, mask=ok, other=0)
    row = hp.to(tl.int64) * UPP + u % UPP
    live = ok & (tl.load(count_ptr + row * sn_u + h * sn_h, mask=ok, other=0) > 0)
    c = tl.load(cent_ptr + row[:, None] * sc_u + h * sc_h + d[None, :] * sc_d, mask=live[:, None],
                other=0.0).to(tl.float32)
    logit = scale * tl.sum(q[:, None, :] * c[None, :, :], axis=2)
    return tl.where(live[None, :], logit, float("-inf")), live


@triton.jit
def _unit_partials_kernel(
    q_ptr, cent_ptr, count_ptr, table_ptr, slots_ptr, end_ptr, heads_ptr, part_ptr,
    cand_start, M, scale, phase_now,
    sq_b, sq_h, sq_d,
    sc_u, sc_h, sc_d,
    sn_u, sn_h,
    st_r, st_m,
    sh_b, sh_h,
    sp_b, sp_h, sp_c,
    G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, UPP: tl.constexpr,
    BLOCK_U: tl.constexpr, CHUNK_U: tl.constexpr,
):
    """Program (row b, KV head h, chunk c): per query head the running max and sum of exp over the row's live units
    [c * CHUNK_U, (c + 1) * CHUNK_U), written as part[b, h, c, 0:GP] (max) and [GP:2 GP] (sum)."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    c = tl.program_id(2)
    if tl.load(heads_ptr + b * sh_b + h * sh_h).to(tl.int32) != phase_now:
        return
    slot = tl.load(slots_ptr + b).to(tl.int64)
    n_units = tl.maximum(tl.minimum(tl.load(end_ptr + b), M) - cand_start, 0) * UPP
    g = tl.arange(0, GP)
    d = tl.arange(0, D)
    q = tl.load(q_ptr + b * sq_b + (h * G + g).to(tl.int64)[:, None] * sq_h + d[None, :] * sq_d,
                mask=(g < G)[:, None], other=0.0).to(tl.float32)
    m = tl.full([GP], float("-inf"), tl.float32)
    s = tl.zeros([GP], tl.float32)
    for u0 in range(c * CHUNK_U, c * CHUNK_U + CHUNK_U, BLOCK_U):
        u = u0 + tl.arange(0, BLOCK_U)
        logit, _ = _unit_logits(q, cent_ptr, count_ptr, table_ptr, slot, u, u < n_units, h, cand_start,
                                sc_u, sc_h, sc_d, sn_u, sn_h, st_r, st_m, scale, D, UPP)
        m_new = tl.maximum(m, tl.max(logit, axis=1))
        alive = m_new > float("-inf")
        s = tl.where(alive, s * tl.exp(m - m_new) + tl.sum(tl.exp(logit - m_new[:, None]), axis=1), s)
        m = m_new
    out = part_ptr + b * sp_b + h * sp_h + c * sp_c + g
    tl.store(out, m)
    tl.store(out + GP, s)


@triton.jit
def _unit_pages_kernel(
    q_ptr, cent_ptr, count_ptr, range_ptr, table_ptr, slots_ptr, end_ptr, heads_ptr, part_ptr, out_ptr,
    cand_start, M, n_chunks, scale, phase_now,
    sq_b, sq_h, sq_d,
    sc_u, sc_h, sc_d,
    sn_u, sn_h,
    sr_p, sr_h, sr_i,
    st_r, st_m,
    sh_b, sh_h,
    sp_b, sp_h, sp_c,
    so_b, so_h, so_m,
    G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, UPP: tl.constexpr, CHUNKS: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    """Program (row b, KV head h, page block): the softmax normaliser from every chunk's partials, then each
    candidate page's best group-mean probability over its units ranges[hp, h, 0] .. ranges[hp, h, 1]."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    j = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    if tl.load(heads_ptr + b * sh_b + h * sh_h).to(tl.int32) != phase_now:
        return
    slot = tl.load(slots_ptr + b).to(tl.int64)
    end = tl.minimum(tl.load(end_ptr + b), M)
    n_units = tl.maximum(end - cand_start, 0) * UPP
    g = tl.arange(0, GP)
    d = tl.arange(0, D)
    ch = tl.arange(0, CHUNKS)
    part = part_ptr + b * sp_b + h * sp_h + ch.to(tl.int64)[:, None] * sp_c + g[None, :]
    pm = tl.load(part, mask=(ch < n_chunks)[:, None], other=float("-inf"))  # [CHUNKS, GP]
    ps = tl.load(part + GP, mask=(ch < n_chunks)[:, None], other=0.0)
    m = tl.max(pm, axis=0)
    s = tl.sum(tl.where(pm > float("-inf"), ps * tl.exp(pm - m[None, :]), 0.0), axis=0)
    inv = tl.where((g < G) & (s > 0), 1.0 / tl.where(s > 0, s, 1.0), 0.0)
    q = tl.load(q_ptr + b * sq_b + (h * G + g).to(tl.int64)[:, None] * sq_h + d[None, :] * sq_d,
                mask=(g < G)[:, None], other=0.0).to(tl.float32)
    cand = (j >= cand_start) & (j < end)
    hp = tl.load(table_ptr + slot * st_r + j.to(tl.int64) * st_m, mask=cand, other=0).to(tl.int64)
    first = tl.load(range_ptr + hp * sr_p + h * sr_h, mask=cand, other=0)
    last = tl.load(range_ptr + hp * sr_p + h * sr_h + sr_i, mask=cand, other=-1)
    best = tl.full([BLOCK_P], float("-inf"), tl.float32)
    for r in range(0, tl.max(last - first) + 1):  # the block's widest page: a page holds few units
        u = first + r
        logit, live = _unit_logits(q, cent_ptr, count_ptr, table_ptr, slot, u, cand & (u <= last) & (u < n_units),
                                   h, cand_start, sc_u, sc_h, sc_d, sn_u, sn_h, st_r, st_m, scale, D, UPP)
        a = tl.sum(tl.exp(logit - m[:, None]) * inv[:, None], axis=0) / G
        best = tl.maximum(best, tl.where(live, a, float("-inf")))
    tl.store(out_ptr + b * so_b + h * so_h + j.to(tl.int64) * so_m, best, mask=j < M)


def unit_scratch_size(group: int, max_pages: int, units_per_page: int) -> int:
    """Floats per (row, KV head) of unit_page_scores' scratch: each chunk's softmax max and sum per query head."""
    return 2 * triton.next_power_of_2(group) * triton.cdiv(max_pages * units_per_page, CHUNK)


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
    """See naive_unit_page_scores. scratch: float32 [>= B, H, >= 2 * next_power_of_2(G) * cdiv(M * upp, CHUNK)], one
    row per (row, head) for the chunks' softmax partials (allocated here when None; the engine passes a persistent
    one of unit_scratch_size floats)."""
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
    G = Hq // H
    GP, n_chunks = triton.next_power_of_2(G), triton.cdiv(M * upp, CHUNK)
    if scratch is None:
        scratch = empty(B, H, unit_scratch_size(G, M, upp), dtype=torch.float32, device=q.device)
    assert scratch.shape[0] >= B and scratch.shape[1] == H and scratch.shape[2] >= 2 * GP * n_chunks
    assert scratch.stride(2) == 1
    part = scratch[:B, :, :2 * GP * n_chunks].unflatten(2, (n_chunks, 2 * GP))
    out = empty(B, H, M, dtype=torch.float32, device=q.device)
    common = dict(G=G, GP=GP, D=D, UPP=upp)
    _unit_partials_kernel[(B, H, n_chunks)](
        q, centroids, counts, page_table, req_slots, cand_end, heads, part,
        cand_start, M, float(scale), int(phase == PHASE_NOW),
        *q.stride(), *centroids.stride(), *counts.stride(), *page_table.stride(), *heads.stride(), *part.stride()[:3],
        BLOCK_U=UNITS, CHUNK_U=CHUNK, **common,
    )
    _unit_pages_kernel[(B, H, triton.cdiv(M, PAGES))](
        q, centroids, counts, ranges, page_table, req_slots, cand_end, heads, part, out,
        cand_start, M, n_chunks, float(scale), int(phase == PHASE_NOW),
        *q.stride(), *centroids.stride(), *counts.stride(), *ranges.stride(), *page_table.stride(), *heads.stride(),
        *part.stride()[:3], *out.stride(),
        CHUNKS=triton.next_power_of_2(n_chunks), BLOCK_P=PAGES, **common,
    )
    return out
