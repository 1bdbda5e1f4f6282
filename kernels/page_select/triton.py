"""Triton page scoring, and selection with its slot assignment and commit.

score_pages: one kernel computes the logits of a block of candidate pages for the G query heads of a KV head and,
for mean_softmax, that block's softmax statistics (max and sum of exponentials per query head); a second kernel
combines the per-block statistics of a row (a few hundred floats) and pools a block of pages. Max pooling needs no
statistics and pools in the first kernel. select_slots: a bitonic top-k (tl.topk) over (score, page) keys packed into
int64 (the packing makes the order total: ties by lower page id), in chunks for long rows, then over the chunks'
winners; the last stage also assigns the selected pages to slots, commits them to the slot table and writes the
recall codes, one program per (row, KV head).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._alloc import empty
from .._utils import check_device, check_index_vectors
from .naive import PHASE_NOW, POOLINGS, VICTIM_SHIFT, check_hysteresis, check_phase, check_victims

# Sortable int32 key of -inf (see _sort_keys): keys at or below it are -inf (or padding) and select nothing.
_NEG_INF_KEY = -2139095041


@triton.jit
def _page_logits_kernel(
    q_ptr, summ_ptr, pt_ptr, slots_ptr, cend_ptr, heads_ptr, logits_ptr, stats_ptr, scores_ptr,
    cand_start, M, NB, scale,
    sq_b, sq_h, sq_d,
    ss_p, ss_h, ss_mm, ss_d,
    spt_r, spt_m,
    s_slot, s_cend,
    sh_b, sh_h,
    sl_b, sl_h, sl_m,
    st_part, st_b,
    so_b, so_h, so_m,
    G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLOCK_PAGES: tl.constexpr,
    POOL_MAX: tl.constexpr, HEADS: tl.constexpr, WANT: tl.constexpr, Q_BY_SLOT: tl.constexpr,
):
    """Scaled logits s[j, g] of the G query heads of KV head h over one block of candidate pages.

    mean_softmax: writes logits[b, h, j, g] (scratch, g contiguous) for candidate j and the block's statistics
    stats[0/1, b, h*G+g, blk] (max, sum of exp(logit - max)); blocks without candidates write nothing (the
    pooling kernel skips them). max: writes scores[b, h, j] for every j of the block directly.
    HEADS: only heads with heads[b, h] == WANT are scored; the others' programs exit, writing nothing.
    """
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    if HEADS:  # noqa: SIM102 (a constexpr branch around a runtime one)
        if tl.load(heads_ptr + b * sh_b + h * sh_h).to(tl.int32) != WANT:
            return
    blk = tl.program_id(2)
    j0 = blk * BLOCK_PAGES
    j = j0 + tl.arange(0, BLOCK_PAGES)
    end = tl.minimum(tl.load(cend_ptr + b * s_cend), M)
    neg_inf = float("-inf")
    if (j0 < end) & (j0 + BLOCK_PAGES > cand_start):
        slot = tl.load(slots_ptr + b * s_slot).to(tl.int64)
        q_row = slot if Q_BY_SLOT else b
        d = tl.arange(0, D)
        g = tl.arange(0, GP)
        g_ok = g < G
        is_cand = (j >= cand_start) & (j < end)
        page = tl.load(pt_ptr + slot * spt_r + j.to(tl.int64) * spt_m, mask=is_cand, other=0).to(tl.int64)
        rows = summ_ptr + page[:, None] * ss_p + h * ss_h + d[None, :].to(tl.int64) * ss_d
        kmin = tl.load(rows, mask=is_cand[:, None], other=0.0)
        kmax = tl.load(rows + ss_mm, mask=is_cand[:, None], other=0.0)
        # max(q*a, q*b) = relu(q)*max(a,b) + min(q,0)*min(a,b) termwise: exact products, fp32 sums. On CUDA
        # cores: the same products through tl.dot (heads or pages as MMA rows) ran 6-60x slower (NOTES.md).
        lo = tl.minimum(kmin, kmax).to(tl.float32)
        hi = tl.maximum(kmin, kmax).to(tl.float32)
        s = tl.zeros([BLOCK_PAGES, GP], tl.float32)
        for gg in tl.static_range(G):
            qg = tl.load(q_ptr + q_row * sq_b + (h * G + gg) * sq_h + d * sq_d).to(tl.float32)
            sg = tl.sum(tl.maximum(qg, 0.0)[None, :] * hi + tl.minimum(qg, 0.0)[None, :] * lo, axis=1)
            s = tl.where(g[None, :] == gg, sg[:, None], s)
        ok = is_cand[:, None] & g_ok[None, :]
        s = tl.where(ok, s * scale, neg_inf)
        if POOL_MAX:
            pooled = tl.max(s, axis=1)
            tl.store(scores_ptr + b * so_b + h * so_h + j.to(tl.int64) * so_m, pooled, mask=j < M)
        else:
            tl.store(logits_ptr + b * sl_b + h * sl_h + j[:, None].to(tl.int64) * sl_m + g[None, :], s, mask=ok)
            m_blk = tl.max(s, axis=0)
            m_safe = tl.where(m_blk == neg_inf, 0.0, m_blk)
            l_blk = tl.sum(tl.exp(s - m_safe[None, :]), axis=0)
            st = stats_ptr + b * st_b + (h * G + g) * NB + blk
            tl.store(st, m_blk, mask=g_ok)
            tl.store(st + st_part, l_blk, mask=g_ok)
    else:
        if POOL_MAX:
            tl.store(scores_ptr + b * so_b + h * so_h + j.to(tl.int64) * so_m,
                     tl.full([BLOCK_PAGES], neg_inf, tl.float32), mask=j < M)


@triton.jit
def _pool_scores_kernel(
    logits_ptr, stats_ptr, cend_ptr, heads_ptr, scores_ptr,
    cand_start, M, NB,
    sl_b, sl_h, sl_m,
    st_part, st_b,
    s_cend,
    sh_b, sh_h,
    so_b, so_h, so_m,
    G: tl.constexpr, GP: tl.constexpr, STATS_PAGES: tl.constexpr, STATS_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr, HEADS: tl.constexpr, WANT: tl.constexpr,
):
    """scores[b, h, block of pages]: mean over the G query heads of the softmax over the row's candidates.

    The softmax max / sum per query head come from the per-block statistics of the logits kernel (blocks of
    STATS_PAGES pages; blocks without candidates were not written and are masked here).
    """
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    if HEADS:  # noqa: SIM102 (a constexpr branch around a runtime one)
        if tl.load(heads_ptr + b * sh_b + h * sh_h).to(tl.int32) != WANT:
            return
    j = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    end = tl.minimum(tl.load(cend_ptr + b * s_cend), M)
    g = tl.arange(0, GP)
    g_ok = g < G
    neg_inf = float("-inf")
    m_i = tl.full([GP], neg_inf, tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    for s0 in range(0, NB, STATS_BLOCK):
        blk = s0 + tl.arange(0, STATS_BLOCK)
        has = (blk < NB) & (blk * STATS_PAGES < end) & (blk * STATS_PAGES + STATS_PAGES > cand_start)
        st = stats_ptr + b * st_b + (h * G + g)[None, :] * NB + blk[:, None]
        msk = has[:, None] & g_ok[None, :]
        m_b = tl.load(st, mask=msk, other=neg_inf)
        l_b = tl.load(st + st_part, mask=msk, other=0.0)
        m_new = tl.maximum(m_i, tl.max(m_b, axis=0))
        m_safe = tl.where(m_new == neg_inf, 0.0, m_new)
        l_i = l_i * tl.exp(m_i - m_safe) + tl.sum(l_b * tl.exp(m_b - m_safe[None, :]), axis=0)
        m_i = m_new
    m_safe = tl.where(m_i == neg_inf, 0.0, m_i)
    # l >= 1 for a head with candidates (the block holding its max contributes exp(0)); else every term is 0.
    inv_l = 1.0 / tl.maximum(l_i, 1.0)
    is_cand = (j >= cand_start) & (j < end)
    s = tl.load(logits_ptr + b * sl_b + h * sl_h + j[:, None].to(tl.int64) * sl_m + g[None, :],
                mask=is_cand[:, None] & g_ok[None, :], other=neg_inf)
    pooled = tl.sum(tl.exp(s - m_safe[None, :]) * inv_l[None, :], axis=1) / G
    tl.store(scores_ptr + b * so_b + h * so_h + j.to(tl.int64) * so_m, tl.where(is_cand, pooled, neg_inf),
             mask=j < M)


# Launch settings (benchmarks/NOTES.md has the sweep they come from).
LOGITS_BLOCK_PAGES = 8
LOGITS_WARPS = 1
POOL_BLOCK = 256
POOL_WARPS = 4
TOPK_CHUNK = 512  # pages per chunk of a multi-stage top-k
TOPK_WARPS = 4
TOPK_SINGLE = 1024  # rows up to this many pages take one stage
TOPK_SINGLE_WARPS = 8


def _heads_args(heads: torch.Tensor | None, phase: int, like: torch.Tensor) -> tuple:
    """(pointer, strides, HEADS, WANT) of the phase's head mask: heads[b, h] == WANT selects in this phase."""
    check_phase(phase)
    if heads is None:
        return like, (0, 0), False, 1
    return heads, heads.stride(), True, int(phase == PHASE_NOW)


def _launch_logits(q, summaries, page_table, req_slots, cand_start, cand_end, heads_args, q_by_slot, scale,
                   pool_max, logits, stats, scores, block_pages, num_warps):
    B, H = req_slots.shape[0], summaries.shape[1]
    G = q.shape[1] // H
    D = q.shape[2]
    M = page_table.shape[1]
    NB = triton.cdiv(M, block_pages)
    gp = triton.next_power_of_2(G)
    heads, heads_strides, with_heads, want = heads_args
    _page_logits_kernel[(B, H, NB)](
        q, summaries, page_table, req_slots, cand_end, heads, logits, stats, scores,
        cand_start, M, NB, scale,
        *q.stride(), *summaries.stride(), *page_table.stride(), req_slots.stride(0), cand_end.stride(0),
        *heads_strides, *logits.stride()[:3], stats.stride(0), stats.stride(1), *scores.stride(),
        G=G, GP=gp, D=D, BLOCK_PAGES=block_pages, POOL_MAX=pool_max, HEADS=with_heads, WANT=want,
        Q_BY_SLOT=q_by_slot,
        num_warps=num_warps,
    )


def _launch_pool(logits, stats, cand_end, heads_args, scores, cand_start, stats_pages, block_m, num_warps):
    B, H, M = scores.shape
    G = logits.shape[3]
    NB = stats.shape[-1]
    heads, heads_strides, with_heads, want = heads_args
    _pool_scores_kernel[(B, H, triton.cdiv(M, block_m))](
        logits, stats, cand_end, heads, scores,
        cand_start, M, NB,
        *logits.stride()[:3], stats.stride(0), stats.stride(1), cand_end.stride(0), *heads_strides, *scores.stride(),
        G=G, GP=triton.next_power_of_2(G), STATS_PAGES=stats_pages, STATS_BLOCK=min(1024, triton.next_power_of_2(NB)),
        BLOCK_M=block_m, HEADS=with_heads, WANT=want,
        num_warps=num_warps,
    )


def score_pages(
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
    if pooling not in POOLINGS:
        raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
    check_device(q, summaries, page_table, req_slots, cand_end)
    check_index_vectors(req_slots=req_slots, cand_end=cand_end)
    B, Hq, D = req_slots.shape[0], q.shape[1], q.shape[2]
    H = summaries.shape[1]
    M = page_table.shape[1]
    assert Hq % H == 0 and summaries.shape[2:] == (2, D) and D >= 16 and D & (D - 1) == 0
    assert q_by_slot or q.shape[0] == B
    heads_args = _heads_args(heads, phase, req_slots)
    if heads is not None:
        check_device(heads)
        assert heads.shape == (B, H) and heads.dtype == torch.bool
    block_pages = min(LOGITS_BLOCK_PAGES, triton.next_power_of_2(M))
    scores = empty(B, H, M, dtype=torch.float32, device=q.device)
    if pooling == "max":
        _launch_logits(q, summaries, page_table, req_slots, cand_start, cand_end, heads_args, q_by_slot, scale, True,
                       scores[..., None], scores.view(1, -1, 1), scores, block_pages, LOGITS_WARPS)
        return scores
    # Scratch: only candidate entries / blocks are written and read; poisoned like outputs in tests.
    logits = empty(B, H, M, Hq // H, dtype=torch.float32, device=q.device)  # [b, h, page, g]
    stats = empty(2, B, Hq, triton.cdiv(M, block_pages), dtype=torch.float32, device=q.device)
    _launch_logits(q, summaries, page_table, req_slots, cand_start, cand_end, heads_args, q_by_slot, scale, False,
                   logits, stats, scores, block_pages, LOGITS_WARPS)
    _launch_pool(logits, stats, cand_end, heads_args, scores, cand_start, block_pages,
                 max(16, min(POOL_BLOCK, triton.next_power_of_2(M))), POOL_WARPS)
    return scores


@triton.jit
def _sort_keys(in_ptr, b, h, n, si_b, si_h, si_j, c, CHUNK: tl.constexpr, PACKED_IN: tl.constexpr,
               NEG_INF_KEY: tl.constexpr):
    """Chunk c of row (b, h) of `in` as int64 keys whose descending order is descending score, ties by lower page.

    A score x at page j packs into (key(x) << 32) | (2^31 - 1 - j), key(x) an int32 that orders like x. Packed
    input (the winners of an earlier stage) is read as is; lanes past n are padding, below every real key."""
    j = c * CHUNK + tl.arange(0, CHUNK)
    ok = j < n
    src = in_ptr + b * si_b + h * si_h + j.to(tl.int64) * si_j
    if PACKED_IN:
        pad = tl.full([CHUNK], NEG_INF_KEY, tl.int32).to(tl.int64) << 32
        x = tl.where(ok, tl.load(src, mask=ok, other=0), pad)
    else:
        x = _pack_key(tl.load(src, mask=ok, other=float("-inf")), j)
    return x


@triton.jit
def _pack_key(score, j):
    """The int64 key of `score` at page j (see _sort_keys)."""
    f = score.to(tl.float32)
    f = tl.where(f == 0.0, 0.0, f)  # -0.0 ties with +0.0, as in torch's sort
    bits = f.to(tl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # negative floats: flip the magnitude bits
    return (key.to(tl.int64) << 32) | (0x7FFFFFFF - j).to(tl.int64)


# A mark in a scores row that _delta_in_row writes over the resident pages' scores: a NaN payload no arithmetic makes.
_HELD_MARK = tl.constexpr(0x7FC0DEAD)  # globals a jitted function reads must be constexpr


@triton.jit
def _delta_in_row(row, si_j, n, old, ok, sel, top):
    """The slots after a selection (as _select_row's [k, k] compares give them: resident pages keep their slot, the
    r-th incoming page in selection order takes the r-th free slot in slot order), computed through the scores row
    `row` [n] instead: the top-k has read it, so it is scratch from here (only where the caller made it so). A resident
    slot is one whose page's key is at least the smallest selected key (keys are unique); the resident pages are marked
    in the row so that a selected page knows whether it is held; the incoming pages are written to the row's head in
    rank order and each free slot reads its own. Four barriers, where the compares took ~28 (sm_90 SASS)."""
    words = row.to(tl.pointer_type(tl.int32))
    on = (old >= 0) & (old < n)
    kth = tl.min(tl.where(sel != -1, top, 0x7FFFFFFFFFFFFFFF), axis=0)
    resident = on & (_pack_key(tl.load(row + old * si_j, mask=on, other=float("-inf")), old) >= kth)
    tl.debug_barrier()  # every thread's top-k and key loads are done before the row is written
    tl.store(words + old * si_j, tl.full(old.shape, _HELD_MARK, tl.int32), mask=on)
    tl.debug_barrier()
    incoming = (sel != -1) & (tl.load(words + sel * si_j, mask=sel != -1, other=0) != _HELD_MARK)
    free = ok & ~resident
    in_rank = tl.cumsum(incoming.to(tl.int32), axis=0) - 1
    free_rank = tl.cumsum(free.to(tl.int32), axis=0) - 1
    filled = free & (free_rank < tl.sum(incoming.to(tl.int32), axis=0))
    tl.debug_barrier()  # every mark is read before the row's head takes the incoming pages
    tl.store(words + in_rank * si_j, sel, mask=incoming)
    tl.debug_barrier()
    placed = tl.load(words + free_rank * si_j, mask=filled, other=-1)
    return tl.where(resident, old, tl.where(filled, placed, -1))


@triton.jit
def _boost_resident(in_ptr, b, h, si_b, si_h, si_j, held, lo, hi, bonus):
    """Hysteresis, in place: the scores of row (b, h) at the pages `held` (a row's slots, -1 empty) within
    [lo, hi) times bonus. The barrier orders these stores before the program's reads of the row."""
    mine = (held >= lo) & (held < hi)
    ptrs = in_ptr + b * si_b + h * si_h + held.to(tl.int64) * si_j
    tl.store(ptrs, tl.load(ptrs, mask=mine, other=0.0) * bonus, mask=mine)
    tl.debug_barrier()


@triton.jit
def _topk_kernel(
    in_ptr, out_ptr, heads_ptr, n, H,
    si_b, si_h, si_j,
    so_b, so_h, so_j,
    sh_b, sh_h,
    slots_ptr, req_ptr, s_req, st_r, st_h, st_k, K, bonus,
    KP: tl.constexpr, CHUNK: tl.constexpr, PACKED_IN: tl.constexpr, WANT: tl.constexpr, NEG_INF_KEY: tl.constexpr,
    HYST: tl.constexpr,
):
    """An early stage of a long row's top-k: the KP best packed keys of chunk c of row (b, h) go to
    out[b, h, c*KP : c*KP + KP]. Heads outside the phase (heads[b, h] != WANT) exit. HYST (the first stage): the
    chunk's scores of resident pages (slots[req_slots[b], h]) are multiplied by bonus first, in place."""
    r = tl.program_id(0)
    c = tl.program_id(1)
    b = (r // H).to(tl.int64)
    h = (r % H).to(tl.int64)
    if tl.load(heads_ptr + b * sh_b + h * sh_h).to(tl.int32) != WANT:
        return
    if HYST:
        i = tl.arange(0, KP)
        slot = tl.load(req_ptr + b * s_req).to(tl.int64)
        held = tl.load(slots_ptr + slot * st_r + h * st_h + i.to(tl.int64) * st_k, mask=i < K, other=-1)
        _boost_resident(in_ptr, b, h, si_b, si_h, si_j, held, c * CHUNK, tl.minimum(c * CHUNK + CHUNK, n), bonus)
    top = tl.topk(_sort_keys(in_ptr, b, h, n, si_b, si_h, si_j, c, CHUNK, PACKED_IN, NEG_INF_KEY), KP)
    i = tl.arange(0, KP)
    tl.store(out_ptr + b * so_b + h * so_h + (c * KP + i).to(tl.int64) * so_j, top)


@triton.jit
def _victim_entries(vict_ptr, age_ptr, r, h, sv_r, sv_h, sv_e, sa_r, sa_h, sa_e, V, VP: tl.constexpr):
    """Row (r, h)'s victim entries: their ids, which exist (< V), pointers to their pages and stamps, their pages (-1
    empty) and stamps."""
    e = tl.arange(0, VP)
    e_ok = e < V
    v_ptrs = vict_ptr + r * sv_r + h * sv_h + e.to(tl.int64) * sv_e
    a_ptrs = age_ptr + r * sa_r + h * sa_h + e.to(tl.int64) * sa_e
    return e, e_ok, v_ptrs, a_ptrs, tl.load(v_ptrs, mask=e_ok, other=-1), tl.load(a_ptrs, mask=e_ok, other=-1)


@triton.jit
def _eviction_keys(held, age, e):
    """The entries' eviction order (full, age, entry) as one int64 key each, smallest first (age + 1 < 2**32; entry
    in the low 16 bits)."""
    return ((held != -1).to(tl.int64) << 48) | ((age.to(tl.int64) + 1) << 16) | e.to(tl.int64)


@triton.jit
def _victim_moves(vict_ptr, age_ptr, r, h, sv_r, sv_h, sv_e, sa_r, sa_h, sa_e, V, old, new, changed,
                  KP: tl.constexpr, VP: tl.constexpr, SHIFT: tl.constexpr):
    """The packed victim op of each slot of row (r, h) for the change old -> new, and the row's victim entries and
    stamps updated in place (naive _victim_moves): hits come from their entry, which is freed; the outgoing pages
    take, in slot order, the entries no hit reads, free ones first, then the oldest, ties by entry. With more
    entries than slots (VP > KP) the outgoing pages need only the KP first entries in that order: a top-k of the
    entries' keys instead of every entry's rank ([VP, VP] compares: 16 times the work at four budgets of victims)."""
    e, e_ok, v_ptrs, a_ptrs, held, age = _victim_entries(vict_ptr, age_ptr, r, h, sv_r, sv_h, sv_e, sa_r, sa_h, sa_e,
                                                         V, VP)
    hit = changed[:, None] & (held[None, :] == new[:, None]) & (held != -1)[None, :]  # [slot, entry]
    source = tl.max(tl.where(hit, e[None, :], -1), axis=1)
    read = tl.max(hit.to(tl.int32), axis=0) > 0
    elig = e_ok & ~read
    key = _eviction_keys(held, age, e)
    evicting = changed & (old != -1)
    ev_rank = tl.cumsum(evicting.to(tl.int32), axis=0) - 1
    if VP > KP:
        # ~key orders the eligible entries first-to-last from the top; FAR (below every ~key) marks the others.
        FAR: tl.constexpr = -(1 << 62)
        firsts = tl.topk(tl.where(elig, ~key, FAR), KP)
        j = tl.arange(0, KP)
        pick = tl.sum(tl.where(j[None, :] == ev_rank[:, None], firsts[None, :], 0), axis=1)  # [slot]
        target = tl.where(evicting & (pick != FAR), (~pick) & 0xFFFF, -1)
        to = target[:, None] == e[None, :]  # [slot, entry]
    else:
        rank = tl.sum(((key[None, :] < key[:, None]) & elig[None, :]).to(tl.int32), axis=1)
        to = evicting[:, None] & elig[None, :] & (rank[None, :] == ev_rank[:, None])  # [slot, entry]
    evict = tl.max(tl.where(to, e[None, :], -1), axis=1)
    taken = tl.max(to.to(tl.int32), axis=0) > 0
    clock = tl.max(age, axis=0) + 1
    tl.store(v_ptrs, tl.where(taken, tl.sum(tl.where(to, old[:, None], 0), axis=0), tl.where(read, -1, held)),
             mask=e_ok)
    tl.store(a_ptrs, tl.where(taken, clock + tl.sum(tl.where(to, ev_rank[:, None], 0), axis=0),
                              tl.where(read, -1, age)), mask=e_ok)
    return tl.where(changed, (evict + 1) | ((source + 1) << SHIFT), 0)


# Tags _victim_moves_in_row writes into a scores row: an entry's id at its page (a hit's source), a page being read.
_HIT_TAG = tl.constexpr(0x7FD00000)  # | entry (< 2^16); NaN payloads above every score's bits and _HELD_MARK
_READ_TAG = tl.constexpr(0x7FE00000)


@triton.jit
def _victim_moves_in_row(row, si_j, n, ops_row, so_k, K, vict_ptr, age_ptr, r, h, sv_r, sv_h, sv_e, sa_r, sa_h, sa_e,
                         V, old, new, changed, KP: tl.constexpr, VP: tl.constexpr, SHIFT: tl.constexpr):
    """_victim_moves (the same ops, entries and stamps) through memory instead of [slot, entry] compares: the scores
    row `row` [n] (scratch once _delta_in_row is done with it) carries each entry's id to its page, where a changed
    slot's incoming page finds its source, and the hits back to their entries; the victim ops row `ops_row` [K]
    (written last) carries the eligible entries in eviction order to the evicting slots. A page is in one entry at
    most (a hit frees its entry and only pages leaving a slot enter), as the kernels and references assume. Six
    barriers, where the compares took ~43 (sm_90 SASS)."""
    words = row.to(tl.pointer_type(tl.int32))
    e, e_ok, v_ptrs, a_ptrs, held, age = _victim_entries(vict_ptr, age_ptr, r, h, sv_r, sv_h, sv_e, sa_r, sa_h, sa_e,
                                                         V, VP)
    at = e_ok & (held >= 0) & (held < n)  # an entry whose page a slot can take (the slots' pages are below n)
    tl.debug_barrier()  # the row's last reads (_delta_in_row's) are done
    tl.store(words + held * si_j, tl.full([VP], _HIT_TAG, tl.int32) | e, mask=at)
    tl.debug_barrier()
    look = changed & (new >= 0) & (new < n)
    tag = tl.load(words + new * si_j, mask=look, other=0)
    source = tl.where(look & ((tag >> 16) == (_HIT_TAG >> 16)), tag & 0xFFFF, -1)
    tl.debug_barrier()  # every slot has read its tag before any is overwritten
    tl.store(words + new * si_j, _READ_TAG, mask=source >= 0)
    tl.debug_barrier()
    read = at & (tl.load(words + held * si_j, mask=at, other=0) == _READ_TAG)
    elig = e_ok & ~read
    key = _eviction_keys(held, age, e)
    evicting = changed & (old != -1)
    ev_rank = tl.cumsum(evicting.to(tl.int32), axis=0) - 1
    # The eligible entries first to last (the KP first of them with more entries than slots), -1 past them.
    FAR: tl.constexpr = -(1 << 62)
    if VP > KP:
        firsts = tl.topk(tl.where(elig, ~key, FAR), KP)
        order = tl.where(firsts != FAR, (~firsts) & 0xFFFF, -1)
        pos = tl.arange(0, KP)
    else:
        firsts = tl.sort(tl.where(elig, key, -FAR))
        order = tl.where(firsts != -FAR, firsts & 0xFFFF, -1)
        pos = tl.arange(0, VP)
    tl.store(ops_row + pos.to(tl.int64) * so_k, order.to(tl.int32), mask=pos < K)
    tl.debug_barrier()
    i = tl.arange(0, KP)
    evict = tl.load(ops_row + ev_rank.to(tl.int64) * so_k, mask=evicting & (i < K), other=-1)
    evict = tl.where(evicting, evict, -1)
    clock = tl.max(age, axis=0) + 1
    slot_v = vict_ptr + r * sv_r + h * sv_h + evict.to(tl.int64) * sv_e
    slot_a = age_ptr + r * sa_r + h * sa_h + evict.to(tl.int64) * sa_e
    tl.store(slot_v, old, mask=evict >= 0)
    tl.store(slot_a, clock + ev_rank, mask=evict >= 0)
    tl.store(v_ptrs, -1, mask=read)
    tl.store(a_ptrs, -1, mask=read)
    tl.debug_barrier()  # every slot has read its entry before the caller writes the ops row
    return tl.where(changed, (evict + 1) | ((source + 1) << SHIFT), 0)


@triton.jit
def _select_slots_kernel(
    H,
    in_ptr, slots_ptr, req_ptr, heads_ptr, flags_ptr, recall_ptr, stats_ptr, vict_ptr, age_ptr, vops_ptr,
    n, K, pad_slot, bonus, V, si_b, si_h, si_j, st_r, st_h, st_k, s_req, sh_b, sh_h, sf_b, sf_h, sr_b, sr_h, sr_k,
    sv_r, sv_h, sv_e, sa_r, sa_h, sa_e, so_b, so_h, so_k, row_ptr, m, sw_b, sw_h, sw_j,
    KP: tl.constexpr, CHUNK: tl.constexpr, PACKED_IN: tl.constexpr, PHASE: tl.constexpr, WANT: tl.constexpr,
    RECALL_ALL: tl.constexpr, STATS: tl.constexpr, NEG_INF_KEY: tl.constexpr, HYST: tl.constexpr,
    VICTIMS: tl.constexpr, VP: tl.constexpr, HIT_STATS: tl.constexpr, SHIFT: tl.constexpr, SCRATCH: tl.constexpr,
):
    """One program per (row b, KV head h): _select_row."""
    pid = tl.program_id(0)
    _select_row(
        (pid // H).to(tl.int64), (pid % H).to(tl.int64),
        in_ptr, slots_ptr, req_ptr, heads_ptr, flags_ptr, recall_ptr, stats_ptr, vict_ptr, age_ptr, vops_ptr,
        n, K, pad_slot, bonus, V, si_b, si_h, si_j, st_r, st_h, st_k, s_req, sh_b, sh_h, sf_b, sf_h, sr_b, sr_h, sr_k,
        sv_r, sv_h, sv_e, sa_r, sa_h, sa_e, so_b, so_h, so_k, row_ptr, m, sw_b, sw_h, sw_j,
        KP, CHUNK, PACKED_IN, PHASE, WANT, RECALL_ALL, STATS, NEG_INF_KEY, HYST, VICTIMS, VP, HIT_STATS, SHIFT,
        SCRATCH)


@triton.jit
def _select_row(
    b, h,
    in_ptr, slots_ptr, req_ptr, heads_ptr, flags_ptr, recall_ptr, stats_ptr, vict_ptr, age_ptr, vops_ptr,
    n, K, pad_slot, bonus, V, si_b, si_h, si_j, st_r, st_h, st_k, s_req, sh_b, sh_h, sf_b, sf_h, sr_b, sr_h, sr_k,
    sv_r, sv_h, sv_e, sa_r, sa_h, sa_e, so_b, so_h, so_k, row_ptr, m, sw_b, sw_h, sw_j,
    KP: tl.constexpr, CHUNK: tl.constexpr, PACKED_IN: tl.constexpr, PHASE: tl.constexpr, WANT: tl.constexpr,
    RECALL_ALL: tl.constexpr, STATS: tl.constexpr, NEG_INF_KEY: tl.constexpr, HYST: tl.constexpr,
    VICTIMS: tl.constexpr, VP: tl.constexpr, HIT_STATS: tl.constexpr, SHIFT: tl.constexpr, SCRATCH: tl.constexpr,
):
    """Row b, KV head h: the last top-k stage, the slot delta against the resident pages, the commit into
    slots[req_slots[b], h], the recall codes and, with VICTIMS, the victim ops and entries (see naive_select_slots).
    Also the last stage of select_chain's fused kernel."""
    r = tl.load(req_ptr + b * s_req).to(tl.int64)
    i = tl.arange(0, KP)
    ok = i < K
    i64 = i.to(tl.int64)
    slot_ptrs = slots_ptr + r * st_r + h * st_h + i64 * st_k
    old = tl.load(slot_ptrs, mask=ok, other=-1)
    mine = tl.load(heads_ptr + b * sh_b + h * sh_h).to(tl.int32) == WANT
    changed = i < 0
    vop_ptrs = vops_ptr + b * so_b + h * so_h + i64 * so_k
    if HIT_STATS:  # another phase's ops count where their codes are this phase's
        vop = tl.load(vop_ptrs, mask=ok, other=0)
    else:
        vop = tl.zeros([KP], tl.int32)
    if mine:
        if HYST and not PACKED_IN:
            _boost_resident(in_ptr, b, h, si_b, si_h, si_j, old, 0, n, bonus)
        top = tl.topk(_sort_keys(in_ptr, b, h, n, si_b, si_h, si_j, 0, CHUNK, PACKED_IN, NEG_INF_KEY), KP)
        page = 0x7FFFFFFF - top.to(tl.int32)  # the low word (truncation)
        # sel[t]: the t-th best page, -1 where its score is -inf (or padding) and past k.
        sel = tl.where(((top >> 32).to(tl.int32) <= NEG_INF_KEY) | (i >= K), -1, page)
        if SCRATCH:
            new = _delta_in_row(row_ptr + b * sw_b + h * sw_h, sw_j, m, old, ok, sel, top)
        else:
            # eq[s, t]: slot s already holds selected page t (padding lanes are -1 and never match).
            eq = (old[:, None] == sel[None, :]) & (sel != -1)[None, :]
            resident = tl.max(eq.to(tl.int32), axis=1) > 0  # per slot
            incoming = (sel != -1) & (tl.max(eq.to(tl.int32), axis=0) == 0)  # per selected page
            free = ok & ~resident
            # The r-th incoming page (in selection order) goes to the r-th free slot (in slot order).
            in_rank = tl.cumsum(incoming.to(tl.int32), axis=0) - 1
            free_rank = tl.cumsum(free.to(tl.int32), axis=0) - 1
            match = free[:, None] & incoming[None, :] & (free_rank[:, None] == in_rank[None, :])
            filled = tl.max(match.to(tl.int32), axis=1) > 0
            placed = tl.sum(tl.where(match, sel[None, :], 0), axis=1)
            new = tl.where(resident, old, tl.where(filled, placed, -1))
        tl.store(slot_ptrs, new, mask=ok)
        if RECALL_ALL:
            changed = new != -1
        else:
            changed = (new != -1) & (new != old)
        if VICTIMS:
            vop = tl.zeros([KP], tl.int32)
            if r != pad_slot:
                if SCRATCH:
                    vop = _victim_moves_in_row(row_ptr + b * sw_b + h * sw_h, sw_j, m, vops_ptr + b * so_b + h * so_h,
                                               so_k, K, vict_ptr, age_ptr, r, h, sv_r, sv_h, sv_e, sa_r, sa_h, sa_e,
                                               V, old, new, changed, KP, VP, SHIFT)
                else:
                    vop = _victim_moves(vict_ptr, age_ptr, r, h, sv_r, sv_h, sv_e, sa_r, sa_h, sa_e, V, old, new,
                                        changed, KP, VP, SHIFT)
            tl.store(vop_ptrs, vop, mask=ok)
    rec_ptrs = recall_ptr + b * sr_b + h * sr_h + i64 * sr_k
    if PHASE == 1:
        flagged = tl.load(flags_ptr + b * sf_b + h * sf_h).to(tl.int32) != 0
        code = tl.where(changed & (flagged | (old < 0)), 1, tl.where(changed, 2, 0))
        tl.store(rec_ptrs, code.to(tl.int8), mask=ok)
    else:
        before = tl.load(rec_ptrs, mask=ok, other=0).to(tl.int32)
        code = tl.where(changed, 2, tl.where(mine, 0, before))
        tl.store(rec_ptrs, code.to(tl.int8), mask=ok & mine)
    if STATS:  # noqa: SIM102 (a constexpr branch around a runtime one)
        if r != pad_slot:  # statistics count real rows only
            tl.atomic_add(stats_ptr + (PHASE - 1), tl.sum(((code == PHASE) & ok).to(tl.float64)))
            if HIT_STATS:
                hits = (code == PHASE) & ok & ((vop >> SHIFT) > 0)
                tl.atomic_add(stats_ptr + (1 + PHASE), tl.sum(hits.to(tl.float64)))


def select_slots(
    scores: torch.Tensor,
    slots: torch.Tensor,
    req_slots: torch.Tensor,
    heads: torch.Tensor,
    phase: int,
    flags: torch.Tensor | None,
    recall: torch.Tensor,
    recall_all: bool = False,
    stats: torch.Tensor | None = None,
    pad_slot: int = -1,
    hysteresis: float = 0.0,
    victims: torch.Tensor | None = None,
    victim_age: torch.Tensor | None = None,
    victim_ops: torch.Tensor | None = None,
    scratch: bool = False,
) -> None:
    """Rows of up to TOPK_SINGLE pages (rounded up to a power of two) take one launch; longer rows are cut into
    chunks of TOPK_CHUNK pages whose winners a further stage reduces, until one stage covers the rest. scratch: the
    scores are the caller's scratch (select_chain's pooled scores), which the last stage may overwrite once its top-k
    is known (_delta_in_row, _victim_moves_in_row); afterwards they hold no scores."""
    launch = select_launch(scores, slots, req_slots, heads, phase, flags, recall, recall_all, stats, pad_slot,
                           hysteresis, victims, victim_age, victim_ops, scratch)
    if launch is not None:
        args, constexprs, num_warps = launch
        _select_slots_kernel[(req_slots.shape[0] * slots.shape[1],)](slots.shape[1], *args, **constexprs,
                                                                     num_warps=num_warps)


def _width(num_pages: int, kp: int) -> int:
    """Lanes of a top-k stage over num_pages keys for kp (a power of two) winners."""
    return max(triton.next_power_of_2(max(num_pages, 1)), kp)


def one_stage(num_pages: int, k: int) -> bool:
    """Whether select_slots' top-k over rows of num_pages pages (or packed winners) for k slots is a single launch:
    its last stage takes TOPK_SINGLE lanes, or one chunk of an earlier stage."""
    kp = max(2, triton.next_power_of_2(k))  # tl.topk of one element would reduce to a scalar
    return _width(num_pages, kp) <= max(TOPK_SINGLE, TOPK_CHUNK, 2 * kp)


def select_launch(scores, slots, req_slots, heads, phase, flags, recall, recall_all=False, stats=None, pad_slot=-1,
                  hysteresis=0.0, victims=None, victim_age=None, victim_ops=None, scratch=False):
    """select_slots' checks and early top-k stages; then (args, constexprs, num_warps) of its last stage: _select_row's
    arguments after (b, h), its constexprs and the launch's warps; None when there is nothing to select."""
    check_phase(phase)
    check_hysteresis(hysteresis)
    check_device(scores, slots, req_slots, heads, recall)
    cached = check_victims(victims, victim_age, victim_ops, slots, recall, recall_all)
    if cached:
        check_device(victims, victim_age, victim_ops)
    check_index_vectors(req_slots=req_slots)
    B, H, M = scores.shape
    k = slots.shape[2]
    assert slots.dim() == 3 and slots.shape[1] == H and slots.dtype == torch.int32 and req_slots.shape == (B,)
    assert heads.shape == (B, H) and recall.shape == (B, H, k) and recall.dtype == torch.int8
    if phase == PHASE_NOW:
        check_device(flags)
        assert flags.shape == (B, H)
    if stats is not None:
        assert stats.shape in ((2,), (4,)) and stats.dtype == torch.float64 and stats.is_contiguous()
    if B * H == 0 or k == 0:
        return None
    want = int(phase == PHASE_NOW)
    kp = max(2, triton.next_power_of_2(k))  # tl.topk of one element would reduce to a scalar
    chunk = max(TOPK_CHUNK, 2 * kp)  # each stage keeps at most half of its input
    hyst, bonus = hysteresis > 0, 1.0 + hysteresis  # the launcher passes it as fp32, rounded as resident_factor
    x, n, packed = scores, M, False
    while not one_stage(n, k):
        n_chunks = triton.cdiv(n, chunk)
        cand = torch.empty(B, H, n_chunks * kp, dtype=torch.int64, device=scores.device)  # scratch
        _topk_kernel[(B * H, n_chunks)](
            x, cand, heads, n, H, *x.stride(), *cand.stride(), *heads.stride(),
            slots, req_slots, req_slots.stride(0), *slots.stride(), k, bonus,
            KP=kp, CHUNK=chunk, PACKED_IN=packed, WANT=want, NEG_INF_KEY=_NEG_INF_KEY, HYST=hyst and not packed,
            num_warps=TOPK_WARPS,
        )
        x, n, packed = cand, n_chunks * kp, True
    width = _width(n, kp)
    vt, va, vo = (victims, victim_age, victim_ops) if cached else (slots, slots, recall)
    args = (
        x, slots, req_slots, heads, heads if flags is None else flags, recall, recall if stats is None else stats,
        vt, va, vo,
        n, k, pad_slot, bonus, vt.shape[2],
        *x.stride(), *slots.stride(), req_slots.stride(0), *heads.stride(),
        *(heads.stride() if flags is None else flags.stride()), *recall.stride(),
        *vt.stride(), *va.stride(), *vo.stride(), scores, M, *scores.stride(),
    )
    constexprs = dict(
        KP=kp, CHUNK=width, PACKED_IN=packed, PHASE=phase, WANT=want, RECALL_ALL=recall_all,
        STATS=stats is not None, NEG_INF_KEY=_NEG_INF_KEY, HYST=hyst,
        VICTIMS=cached, VP=max(2, triton.next_power_of_2(vt.shape[2])) if cached else 2,
        HIT_STATS=cached and stats is not None and stats.shape == (4,), SHIFT=VICTIM_SHIFT, SCRATCH=scratch,
    )
    return args, constexprs, TOPK_SINGLE_WARPS if width > chunk else TOPK_WARPS
