"""Triton page logits, and pooling with selection, slot assignment and commit.

score_pages: one kernel computes the logits of a block of candidate pages for the G query heads of a KV head (max
pooling takes their max there: it needs nothing from the rest of the row). select_slots pools as it loads: a row of
up to 1024 pages is one [pages, G] tile in one program, which takes the softmax statistics (max and sum of
exponentials per query head) from that tile, so the pooling costs no launch and no pass of its own. Then a
bitonic top-k (tl.topk) over (score, page) keys packed into int64 (the packing makes the order total: ties by lower
page id), in chunks for long rows (each chunk first streams the row's logits for the statistics), then over the
chunks' winners; the last stage also assigns the selected pages to slots, commits them to the slot table and writes
the recall codes, one program per (row, KV head).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._alloc import empty
from .._utils import check_device, check_index_vectors
from .naive import PHASE_NOW, check_phase, check_pooling

# Sortable int32 key of -inf (see _sort_keys): keys at or below it are -inf (or padding) and select nothing.
_NEG_INF_KEY = -2139095041


@triton.jit
def _page_logits_kernel(
    q_ptr, summ_ptr, pt_ptr, slots_ptr, cend_ptr, heads_ptr, out_ptr,
    cand_start, M, scale,
    sq_b, sq_h, sq_d,
    ss_p, ss_h, ss_mm, ss_d,
    spt_r, spt_m,
    s_slot, s_cend,
    sh_b, sh_h,
    so_b, so_h, so_m, so_c,
    G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLOCK_PAGES: tl.constexpr,
    POOL_MAX: tl.constexpr, HEADS: tl.constexpr, WANT: tl.constexpr, Q_BY_SLOT: tl.constexpr,
):
    """Scaled logits s[j, g] of the G query heads of KV head h over one block of candidate pages, written to
    out[b, h, j, g] (POOL_MAX: their max to out[b, h, j, 0]); only candidates are written.
    HEADS: only heads with heads[b, h] == WANT are scored; the others' programs exit, writing nothing.
    """
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    if HEADS:  # noqa: SIM102 (a constexpr branch around a runtime one)
        if tl.load(heads_ptr + b * sh_b + h * sh_h).to(tl.int32) != WANT:
            return
    j0 = tl.program_id(2) * BLOCK_PAGES
    j = j0 + tl.arange(0, BLOCK_PAGES)
    end = tl.minimum(tl.load(cend_ptr + b * s_cend), M)
    if (j0 < end) & (j0 + BLOCK_PAGES > cand_start):
        slot = tl.load(slots_ptr + b * s_slot).to(tl.int64)
        q_row = slot if Q_BY_SLOT else b
        d = tl.arange(0, D)
        g = tl.arange(0, GP)
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
        out = out_ptr + b * so_b + h * so_h + j.to(tl.int64) * so_m
        if POOL_MAX:
            tl.store(out, tl.max(tl.where(g[None, :] < G, s * scale, float("-inf")), axis=1), mask=is_cand)
        else:
            tl.store(out[:, None] + g[None, :].to(tl.int64) * so_c, s * scale, mask=is_cand[:, None] & (g < G)[None, :])


# Launch settings (benchmarks/NOTES.md has the sweep they come from).
LOGITS_BLOCK_PAGES = 16
LOGITS_WARPS = 2
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
    check_pooling(pooling)
    check_device(q, summaries, page_table, req_slots, cand_end)
    check_index_vectors(req_slots=req_slots, cand_end=cand_end)
    B, Hq, D = req_slots.shape[0], q.shape[1], q.shape[2]
    H = summaries.shape[1]
    G = Hq // H
    M = page_table.shape[1]
    assert Hq % H == 0 and summaries.shape[2:] == (2, D) and D >= 16 and D & (D - 1) == 0
    assert q_by_slot or q.shape[0] == B
    heads, heads_strides, with_heads, want = _heads_args(heads, phase, req_slots)
    if with_heads:
        check_device(heads)
        assert heads.shape == (B, H) and heads.dtype == torch.bool
    pool_max = pooling == "max"
    block_pages = min(LOGITS_BLOCK_PAGES, triton.next_power_of_2(M))
    logits = empty(B, H, M, 1 if pool_max else G, dtype=torch.float32, device=q.device)
    _page_logits_kernel[(B, H, triton.cdiv(M, block_pages))](
        q, summaries, page_table, req_slots, cand_end, heads, logits,
        cand_start, M, scale,
        *q.stride(), *summaries.stride(), *page_table.stride(), req_slots.stride(0), cand_end.stride(0),
        *heads_strides, *logits.stride(),
        G=G, GP=triton.next_power_of_2(G), D=D, BLOCK_PAGES=block_pages, POOL_MAX=pool_max, HEADS=with_heads,
        WANT=want, Q_BY_SLOT=q_by_slot,
        num_warps=LOGITS_WARPS,
    )
    return logits


@triton.jit
def _pooled_scores(row_ptr, j0, cand_start, end, si_j, si_c, CHUNK: tl.constexpr, NC: tl.constexpr,
                   CP: tl.constexpr, MEAN_SOFTMAX: tl.constexpr, WHOLE_ROW: tl.constexpr):
    """Pooled scores of pages j0 .. j0+CHUNK-1 of one row of logits [M, NC] (see naive.pooled_scores), -inf for
    non-candidates; only candidates are read. mean_softmax needs each column's max and sum of exponentials over
    the row's candidates: with the whole row in this tile (WHOLE_ROW) they come from the tile itself, else from a
    pass over the row's candidates in tiles of CHUNK pages (skipped when this chunk holds none)."""
    neg_inf = float("-inf")
    j = j0 + tl.arange(0, CHUNK)
    cols = tl.arange(0, CP)
    col_ok = cols < NC
    is_cand = (j >= cand_start) & (j < end)
    col_off = cols[None, :].to(tl.int64) * si_c
    x = tl.load(row_ptr + j[:, None].to(tl.int64) * si_j + col_off, mask=is_cand[:, None] & col_ok[None, :],
                other=neg_inf)
    if MEAN_SOFTMAX:
        if WHOLE_ROW:
            m = tl.max(x, axis=0)
            e = tl.exp(x - tl.where(m == neg_inf, 0.0, m)[None, :])
            l_sum = tl.sum(e, axis=0)
        else:
            m = tl.full([CP], neg_inf, tl.float32)
            l_sum = tl.zeros([CP], tl.float32)
            stop = tl.where((j0 < end) & (j0 + CHUNK > cand_start), end, cand_start)
            for t0 in range(cand_start, stop, CHUNK):
                jt = t0 + tl.arange(0, CHUNK)
                xt = tl.load(row_ptr + jt[:, None].to(tl.int64) * si_j + col_off,
                             mask=(jt < stop)[:, None] & col_ok[None, :], other=neg_inf)
                m_new = tl.maximum(m, tl.max(xt, axis=0))
                m_safe = tl.where(m_new == neg_inf, 0.0, m_new)
                l_sum = l_sum * tl.exp(m - m_safe) + tl.sum(tl.exp(xt - m_safe[None, :]), axis=0)
                m = m_new
            e = tl.exp(x - tl.where(m == neg_inf, 0.0, m)[None, :])
        # l >= 1 for a column with candidates (its max contributes exp(0)); without candidates every e is 0.
        pooled = tl.sum(e * (1.0 / tl.maximum(l_sum, 1.0))[None, :], axis=1) / NC
        pooled = tl.where(is_cand, pooled, neg_inf)
    else:
        pooled = tl.max(x, axis=1)
    return pooled


@triton.jit
def _sort_keys(in_ptr, b, h, n, si_b, si_h, si_j, si_c, c, cand_start, cend_ptr, s_cend, CHUNK: tl.constexpr,
               PACKED_IN: tl.constexpr, NC: tl.constexpr, CP: tl.constexpr, MEAN_SOFTMAX: tl.constexpr,
               WHOLE_ROW: tl.constexpr, NEG_INF_KEY: tl.constexpr):
    """Chunk c of row (b, h) as int64 keys whose descending order is descending score, ties by lower page.

    A score x at page j packs into (key(x) << 32) | (2^31 - 1 - j), key(x) an int32 that orders like x. Logits
    input (n = M pages) is pooled first; packed input (the winners of an earlier stage) is read as is, lanes past
    n are padding, below every real key."""
    j = c * CHUNK + tl.arange(0, CHUNK)
    row = in_ptr + b * si_b + h * si_h
    if PACKED_IN:
        ok = j < n
        pad = tl.full([CHUNK], NEG_INF_KEY, tl.int32).to(tl.int64) << 32
        x = tl.where(ok, tl.load(row + j.to(tl.int64) * si_j, mask=ok, other=0), pad)
    else:
        end = tl.minimum(tl.load(cend_ptr + b * s_cend), n)
        f = _pooled_scores(row, c * CHUNK, cand_start, end, si_j, si_c, CHUNK, NC, CP, MEAN_SOFTMAX, WHOLE_ROW)
        f = tl.where(f == 0.0, 0.0, f)  # -0.0 ties with +0.0, as in torch's sort
        bits = f.to(tl.int32, bitcast=True)
        key = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # negative floats: flip the magnitude bits
        x = (key.to(tl.int64) << 32) | (0x7FFFFFFF - j).to(tl.int64)
    return x


@triton.jit
def _topk_kernel(
    in_ptr, out_ptr, heads_ptr, cend_ptr, n, H, cand_start,
    si_b, si_h, si_j, si_c,
    so_b, so_h, so_j,
    sh_b, sh_h, s_cend,
    KP: tl.constexpr, CHUNK: tl.constexpr, PACKED_IN: tl.constexpr, WANT: tl.constexpr, NC: tl.constexpr,
    CP: tl.constexpr, MEAN_SOFTMAX: tl.constexpr, NEG_INF_KEY: tl.constexpr,
):
    """An early stage of a long row's top-k: the KP best packed keys of chunk c of row (b, h) go to
    out[b, h, c*KP : c*KP + KP]. Heads outside the phase (heads[b, h] != WANT) exit."""
    r = tl.program_id(0)
    c = tl.program_id(1)
    b = (r // H).to(tl.int64)
    h = (r % H).to(tl.int64)
    if tl.load(heads_ptr + b * sh_b + h * sh_h).to(tl.int32) != WANT:
        return
    keys = _sort_keys(in_ptr, b, h, n, si_b, si_h, si_j, si_c, c, cand_start, cend_ptr, s_cend, CHUNK, PACKED_IN,
                      NC, CP, MEAN_SOFTMAX, False, NEG_INF_KEY)
    top = tl.topk(keys, KP)
    i = tl.arange(0, KP)
    tl.store(out_ptr + b * so_b + h * so_h + (c * KP + i).to(tl.int64) * so_j, top)


@triton.jit
def _select_slots_kernel(
    in_ptr, cend_ptr, slots_ptr, req_ptr, heads_ptr, flags_ptr, recall_ptr, stats_ptr,
    n, H, K, cand_start, pad_slot,
    si_b, si_h, si_j, si_c, s_cend,
    st_r, st_h, st_k,
    s_req, sh_b, sh_h, sf_b, sf_h,
    sr_b, sr_h, sr_k,
    KP: tl.constexpr, CHUNK: tl.constexpr, PACKED_IN: tl.constexpr, PHASE: tl.constexpr, WANT: tl.constexpr,
    NC: tl.constexpr, CP: tl.constexpr, MEAN_SOFTMAX: tl.constexpr, RECALL_ALL: tl.constexpr,
    STATS: tl.constexpr, NEG_INF_KEY: tl.constexpr,
):
    """One program per (row b, KV head h): the pooling of a row that fits one stage, or the last top-k stage,
    then the slot delta against the resident pages, the commit into slots[req_slots[b], h] and the recall codes
    (see naive_select_slots)."""
    pid = tl.program_id(0)
    b = (pid // H).to(tl.int64)
    h = (pid % H).to(tl.int64)
    r = tl.load(req_ptr + b * s_req).to(tl.int64)
    i = tl.arange(0, KP)
    ok = i < K
    i64 = i.to(tl.int64)
    slot_ptrs = slots_ptr + r * st_r + h * st_h + i64 * st_k
    old = tl.load(slot_ptrs, mask=ok, other=-1)
    mine = tl.load(heads_ptr + b * sh_b + h * sh_h).to(tl.int32) == WANT
    changed = i < 0
    if mine:
        keys = _sort_keys(in_ptr, b, h, n, si_b, si_h, si_j, si_c, 0, cand_start, cend_ptr, s_cend, CHUNK,
                          PACKED_IN, NC, CP, MEAN_SOFTMAX, True, NEG_INF_KEY)
        top = tl.topk(keys, KP)
        page = 0x7FFFFFFF - top.to(tl.int32)  # the low word (truncation)
        # sel[t]: the t-th best page, -1 where its score is -inf (or padding) and past k.
        sel = tl.where(((top >> 32).to(tl.int32) <= NEG_INF_KEY) | (i >= K), -1, page)
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


def select_slots(
    logits: torch.Tensor,
    cand_start: int,
    cand_end: torch.Tensor,
    pooling: str,
    slots: torch.Tensor,
    req_slots: torch.Tensor,
    heads: torch.Tensor,
    phase: int,
    flags: torch.Tensor | None,
    recall: torch.Tensor,
    recall_all: bool = False,
    stats: torch.Tensor | None = None,
    pad_slot: int = -1,
) -> None:
    """Rows of up to TOPK_SINGLE pages (rounded up to a power of two) take one launch; longer rows are cut into
    chunks of TOPK_CHUNK pages whose winners a further stage reduces, until one stage covers the rest."""
    check_phase(phase)
    check_pooling(pooling)
    check_device(logits, cand_end, slots, req_slots, heads, recall)
    check_index_vectors(req_slots=req_slots, cand_end=cand_end)
    B, H, M, C = logits.shape
    k = slots.shape[2]
    assert logits.dtype == torch.float32 and cand_end.shape == (B,)
    assert slots.dim() == 3 and slots.shape[1] == H and slots.dtype == torch.int32 and req_slots.shape == (B,)
    assert heads.shape == (B, H) and recall.shape == (B, H, k) and recall.dtype == torch.int8
    if phase == PHASE_NOW:
        check_device(flags)
        assert flags.shape == (B, H)
    if stats is not None:
        assert stats.shape == (2,) and stats.dtype == torch.float64 and stats.is_contiguous()
    if B * H == 0 or k == 0:
        return
    want = int(phase == PHASE_NOW)
    kp = max(2, triton.next_power_of_2(k))  # tl.topk of one element would reduce to a scalar
    chunk = max(TOPK_CHUNK, 2 * kp)  # each stage keeps at most half of its input
    pool = {"NC": C, "CP": triton.next_power_of_2(C), "MEAN_SOFTMAX": pooling == "mean_softmax",
            "NEG_INF_KEY": _NEG_INF_KEY}
    x, x_strides, n, packed = logits, logits.stride(), M, False
    while (width := max(triton.next_power_of_2(max(n, 1)), kp)) > max(TOPK_SINGLE, chunk):
        n_chunks = triton.cdiv(n, chunk)
        cand = torch.empty(B, H, n_chunks * kp, dtype=torch.int64, device=logits.device)  # scratch
        _topk_kernel[(B * H, n_chunks)](
            x, cand, heads, cand_end, n, H, cand_start, *x_strides, *cand.stride(), *heads.stride(),
            cand_end.stride(0),
            KP=kp, CHUNK=chunk, PACKED_IN=packed, WANT=want, **pool,
            num_warps=TOPK_WARPS,
        )
        x, x_strides, n, packed = cand, (*cand.stride(), 0), n_chunks * kp, True
    _select_slots_kernel[(B * H,)](
        x, cand_end, slots, req_slots, heads, heads if flags is None else flags, recall,
        recall if stats is None else stats,
        n, H, k, cand_start, pad_slot,
        *x_strides, cand_end.stride(0), *slots.stride(), req_slots.stride(0), *heads.stride(),
        *(heads.stride() if flags is None else flags.stride()), *recall.stride(),
        KP=kp, CHUNK=width, PACKED_IN=packed, PHASE=phase, WANT=want, RECALL_ALL=recall_all,
        STATS=stats is not None, **pool,
        num_warps=TOPK_SINGLE_WARPS if width > chunk else TOPK_WARPS,
    )
