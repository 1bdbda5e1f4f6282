"""Triton kernels for attend_kept / attend_recalled and attend_pages (see docs/kernels.md, section split_attention).

attend_kept, grid (B, H, S): each program takes all G query heads of one KV head over a contiguous range of the
row's table and skips the slots being recalled; bf16/fp16 inputs go through tensor-core dots with fp32 sums. It reads
nothing a recall writes, so it runs beside the recall. attend_recalled, grid (B, H): each program attends the G query
heads to its head's recalled pages (a few, or none), merges them with the S partials and normalises; it is all that
follows the recall. S depends only on shapes, so both grids are fixed and the pair can be captured in a CUDA graph. attend_pages, grid
(B, H, S), is the pair in one launch when nothing is recalled before attention: attend_kept's programs over every
page, the last of each (row, KV head) to finish merging them (a ticket counter the caller keeps zeroed between calls).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._alloc import empty
from .._utils import check_device, check_index_vectors, interpret_mode
from ..sparse_attention.triton import _LOG2E, _MAX_SPLITS, _MIN_DOT, _sm_count
from .naive import Partials, check_pages_args, check_split_args

# attend_kept's programs per SM: several waves, so rows of unequal length and the recall beside it balance out.
_PROGRAMS_PER_SM = 4
_CPU_PROGRAMS = 16
# attend_recalled's tokens per iteration: a few recalled pages loaded at once, not one page's round trip after another.
_RECALLED_BLOCK = 64
_RECALLED_WARPS = 4
# attend_pages: pages a program loads at once, and warps.
_PAGES_AT_ONCE = 2
_PAGES_WARPS = 4
_PAGES_MAX_SPLITS = 32
_PAGES_PROGRAMS_PER_SM = 2


def num_splits(batch: int, heads: int, width: int, device: torch.device) -> int:
    """Splits per (row, KV head) of attend_kept (shapes only, never data)."""
    target = _PROGRAMS_PER_SM * _sm_count(device.index) if device.type == "cuda" else _CPU_PROGRAMS
    splits = max(1, min(width, _MAX_SPLITS, triton.cdiv(target, batch * heads)))
    return max(1, triton.cdiv(width, triton.cdiv(width, splits)))  # no split without pages in a full row


def pages_splits(batch: int, heads: int, width: int, device: torch.device) -> int:
    """Programs a (row, KV head) of attend_pages (shapes only): a power of two near two programs an SM in all, at most
    32 (an explicit `splits` is not capped: benchmarks sweep it). H200, Llama-3.1-8B shape, 85 pages a row (session 56): alone (32 layers' calls in one graph) 9.6 µs a call at
    one request with 32 against 11.3 with 43 and 14.3 with 8, and at sixteen 48.6 with 5 against 53.6 with 8
    (FlashInfer's path 18.8 and 58.0); but beside the side lanes (benchmarks/side_lanes.py, 8 layers, every lane)
    sixteen requests took 2.245 ms with 2 against 2.365 with 4, 2.405 with 8, 2.523 with 1 and FlashInfer's 2.370,
    and the served step with 4 was 1.5% slower than FlashInfer's. The count a launch runs is then cut to
    cdiv(W, cdiv(W, splits)) so no split of a full row is empty (85 pages: 32 -> 29)."""
    target = _PAGES_PROGRAMS_PER_SM * _sm_count(device.index) if device.type == "cuda" else _CPU_PROGRAMS
    splits = 1 << (max(1, target // max(1, batch * heads)).bit_length() - 1)
    return max(1, min(splits, _PAGES_MAX_SPLITS, width))


@triton.jit
def _online_block(q, k, v, valid, m_i, l_i, acc, qk_scale, DOT_F32: tl.constexpr):
    """One block of tokens k, v [T, D] (valid [T]; at least one) into the running (m, l, acc) of the query rows q
    [G_PAD, D]: fp32 "ieee" dots for fp32 inputs and the interpreter, which mis-multiplies bf16; tensor cores else."""
    if DOT_F32:
        s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: the block holds a token
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    if DOT_F32:
        pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return m_new, l_i * alpha + tl.sum(p, 1), acc * alpha[:, None] + pv


@triton.jit
def _group_query(q_ptr, b, h, stride_qb, stride_qh, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
                 DOT_F32: tl.constexpr):
    """The G query rows of KV head h in row b, [G_PAD, D] (padding rows 0), fp32 where the dots are."""
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D)
    q = tl.load(q_ptr + b * stride_qb + (h * G + g)[:, None] * stride_qh + d[None, :], mask=(g < G)[:, None],
                other=0.0)
    return q.to(tl.float32) if DOT_F32 else q


@triton.jit
def _store_partial(m_ptr, l_ptr, acc_ptr, b, h, split, m_i, l_i, acc, H: tl.constexpr, G: tl.constexpr,
                   G_PAD: tl.constexpr, D: tl.constexpr, NUM_SPLITS: tl.constexpr):
    """A program's partial (m, l, acc) of its split, at [b, h * G + g, split] of Partials' layout."""
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D)
    part = (b * H * G + h * G + g) * NUM_SPLITS + split
    tl.store(m_ptr + part, m_i, mask=g < G)
    tl.store(l_ptr + part, l_i, mask=g < G)
    tl.store(acc_ptr + part[:, None] * D + d[None, :], acc, mask=(g < G)[:, None])


@triton.jit
def _attend_kept_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, num_pages_ptr, last_len_ptr, n_sink_ptr, n_slots_ptr, recall_ptr, m_ptr, l_ptr,
    acc_ptr,
    qk_scale, pages_per_split, phase,
    stride_qb, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_tb,
    H: tl.constexpr, K: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
    PAGE_SIZE: tl.constexpr, PAGE_TILE: tl.constexpr, NUM_SPLITS: tl.constexpr, DOT_F32: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    d = tl.arange(0, D)
    t = tl.arange(0, PAGE_TILE)
    q = _group_query(q_ptr, b, h, stride_qb, stride_qh, G, G_PAD, D, DOT_F32)

    n_pages = tl.load(num_pages_ptr + b)
    last_len = tl.load(last_len_ptr + b)
    first = tl.load(n_sink_ptr + b)
    n_slots = tl.load(n_slots_ptr + b)
    start = split * pages_per_split
    end = tl.minimum(start + pages_per_split, n_pages)
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D], tl.float32)
    for i in range(start, end):
        s_idx = i - first
        in_slots = (s_idx >= 0) & (s_idx < n_slots)
        code = tl.load(recall_ptr + (b * H + h) * K + s_idx, mask=in_slots, other=0)
        if code != phase:  # a slot being recalled is attend_recalled's
            page = tl.load(table_ptr + b * stride_tb + i).to(tl.int64)
            t_mask = t < tl.where(i == n_pages - 1, last_len, PAGE_SIZE)
            rows = page * PAGE_SIZE + t
            # Masked rows load 0, never stale data (which may be NaN), so their 0 weight times V stays 0.
            k = tl.load(k_ptr + rows[:, None] * stride_kt + h * stride_kh + d[None, :], mask=t_mask[:, None], other=0.0)
            v = tl.load(v_ptr + rows[:, None] * stride_vt + h * stride_vh + d[None, :], mask=t_mask[:, None], other=0.0)
            m_i, l_i, acc = _online_block(q, k, v, t_mask, m_i, l_i, acc, qk_scale, DOT_F32)
    _store_partial(m_ptr, l_ptr, acc_ptr, b, h, split, m_i, l_i, acc, H, G, G_PAD, D, NUM_SPLITS)


@triton.jit
def _attend_recalled_kernel(
    q_ptr, k_ptr, v_ptr, slot_pages_ptr, n_slots_ptr, recall_ptr, m_ptr, l_ptr, acc_ptr, o_ptr,
    qk_scale, phase,
    stride_qb, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_sb, stride_ob, stride_oh,
    H: tl.constexpr, K: tl.constexpr, K_PAD: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D)
    q = _group_query(q_ptr, b, h, stride_qb, stride_qh, G, G_PAD, D, DOT_F32)

    # The head's recalled slots in slot order, BLOCK // PAGE_SIZE pages per iteration: token r of a block belongs to
    # the (j + r // PAGE_SIZE)-th recalled slot, found by its rank among them (no load per slot that is not one).
    s_all = tl.arange(0, K_PAD)
    filled = s_all < tl.minimum(tl.load(n_slots_ptr + b), K)
    codes = tl.load(recall_ptr + (b * H + h) * K + s_all, mask=filled, other=0)
    pages = tl.load(slot_pages_ptr + b * stride_sb + s_all, mask=filled, other=0)
    mine = (codes == phase) & filled
    rank = tl.cumsum(mine.to(tl.int32), 0) - 1
    n_rec = tl.sum(mine.to(tl.int32), 0)
    r = tl.arange(0, BLOCK)
    m_r = tl.full([G_PAD], float("-inf"), tl.float32)
    l_r = tl.zeros([G_PAD], tl.float32)
    acc_r = tl.zeros([G_PAD, D], tl.float32)
    for j in range(0, n_rec, BLOCK // PAGE_SIZE):
        nth = j + r // PAGE_SIZE
        valid = nth < n_rec
        page = tl.sum(tl.where((rank[None, :] == nth[:, None]) & mine[None, :], pages[None, :], 0), 1).to(tl.int64)
        rows = page * PAGE_SIZE + r % PAGE_SIZE
        k = tl.load(k_ptr + rows[:, None] * stride_kt + h * stride_kh + d[None, :], mask=valid[:, None], other=0.0)
        v = tl.load(v_ptr + rows[:, None] * stride_vt + h * stride_vh + d[None, :], mask=valid[:, None], other=0.0)
        m_r, l_r, acc_r = _online_block(q, k, v, valid, m_r, l_r, acc_r, qk_scale, DOT_F32)

    # Each query head of the group: its recalled partial merged with its S kept ones, normalised.
    sp = tl.arange(0, SPLITS_PAD)
    sp_mask = sp < NUM_SPLITS
    for gi in tl.static_range(G):
        hq = h * G + gi
        part = (b * H * G + hq) * NUM_SPLITS + sp
        m = tl.load(m_ptr + part, mask=sp_mask, other=float("-inf"))
        l = tl.load(l_ptr + part, mask=sp_mask, other=0.0)
        acc = tl.load(acc_ptr + part[:, None] * D + d[None, :], mask=sp_mask[:, None], other=0.0)
        mine_g = g == gi
        mr = tl.sum(tl.where(mine_g, m_r, 0.0), 0)
        lr = tl.sum(tl.where(mine_g, l_r, 0.0), 0)
        ar = tl.sum(tl.where(mine_g[:, None], acc_r, 0.0), 0)
        top = tl.maximum(tl.max(m, 0), mr)
        top = tl.where(top == float("-inf"), 0.0, top)  # a row with no token: every weight 0, output 0 (not 0/0)
        w = tl.exp2(m - top)
        wr = tl.exp2(mr - top)
        total = tl.sum(w * l, 0) + wr * lr
        out = (tl.sum(w[:, None] * acc, 0) + wr * ar) / tl.where(total > 0, total, 1.0)
        tl.store(o_ptr + b * stride_ob + hq * stride_oh + d, out.to(o_ptr.dtype.element_ty))


@triton.jit
def _attend_pages_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, num_pages_ptr, last_len_ptr, m_ptr, l_ptr, acc_ptr, tickets_ptr, o_ptr,
    qk_scale, pages_per_split,
    stride_qb, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_tb, stride_ob, stride_oh,
    H: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, G_POW: tl.constexpr, D: tl.constexpr,
    PAGE_SIZE: tl.constexpr, TILE: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    """Grid (B, H, S): each program's partial over its range of the row's pages, TILE // PAGE_SIZE pages a step (their
    loads in flight together: at one request a program's few pages are latency, not bandwidth); the last of a (row,
    KV head)'s S programs to take a ticket merges the S partials and writes o. The merge in the same launch saves
    the second launch's latency, most of what a one-request step's attention costs."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    d = tl.arange(0, D)
    t = tl.arange(0, TILE)
    q = _group_query(q_ptr, b, h, stride_qb, stride_qh, G, G_PAD, D, DOT_F32)
    n_pages = tl.load(num_pages_ptr + b)
    last_len = tl.load(last_len_ptr + b)
    end = tl.minimum((split + 1) * pages_per_split, n_pages)
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D], tl.float32)
    for i in range(split * pages_per_split, end, TILE // PAGE_SIZE):
        nth = i + t // PAGE_SIZE  # each token's page in the row
        t_mask = (nth < end) & (t % PAGE_SIZE < tl.where(nth == n_pages - 1, last_len, PAGE_SIZE))
        page = tl.load(table_ptr + b * stride_tb + nth, mask=nth < end, other=0).to(tl.int64)
        rows = page * PAGE_SIZE + t % PAGE_SIZE
        # Masked rows load 0, never stale data (which may be NaN), so their 0 weight times V stays 0.
        k = tl.load(k_ptr + rows[:, None] * stride_kt + h * stride_kh + d[None, :], mask=t_mask[:, None], other=0.0)
        v = tl.load(v_ptr + rows[:, None] * stride_vt + h * stride_vh + d[None, :], mask=t_mask[:, None], other=0.0)
        m_i, l_i, acc = _online_block(q, k, v, t_mask, m_i, l_i, acc, qk_scale, DOT_F32)
    _store_partial(m_ptr, l_ptr, acc_ptr, b, h, split, m_i, l_i, acc, H, G, G_PAD, D, NUM_SPLITS)
    # Every thread's stores before the ticket, whose release publishes them to the program that merges; that one
    # reads the partials from L2 (.cg): its SM's L1 may hold none of them, but must not serve a stale line.
    tl.debug_barrier()
    ticket = tl.atomic_add(tickets_ptr + b * H + h, 1, sem="acq_rel", scope="gpu")
    if ticket == NUM_SPLITS - 1:
        tl.store(tickets_ptr + b * H + h, 0)  # every program of the pair has taken its ticket: ready for the next call
        # The group's S partials at once (every load before any store, which the compiler could not move them past).
        gs = tl.arange(0, G_POW)
        sp = tl.arange(0, SPLITS_PAD)
        mask = (gs < G)[:, None] & (sp < NUM_SPLITS)[None, :]
        mine = (b * H * G + h * G + gs)[:, None] * NUM_SPLITS + sp[None, :]  # [G_POW, SPLITS_PAD]
        m = tl.load(m_ptr + mine, mask=mask, other=float("-inf"), cache_modifier=".cg")
        l = tl.load(l_ptr + mine, mask=mask, other=0.0, cache_modifier=".cg")
        a = tl.load(acc_ptr + mine[:, :, None] * D + d[None, None, :], mask=mask[:, :, None], other=0.0,
                    cache_modifier=".cg")
        top = tl.max(m, 1)
        top = tl.where(top == float("-inf"), 0.0, top)  # a row with no token: every weight 0, output 0 (not 0/0)
        w = tl.exp2(m - top[:, None])
        total = tl.sum(w * l, 1)
        out = tl.sum(w[:, :, None] * a, 1) / tl.where(total > 0, total, 1.0)[:, None]
        tl.store(o_ptr + b * stride_ob + (h * G + gs)[:, None] * stride_oh + d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=(gs < G)[:, None])


def _check_rows(q: torch.Tensor, *caches: torch.Tensor) -> None:
    for name, t in (("q", q), ("k_cache", caches[0]), ("v_cache", caches[1])):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension, got strides {t.stride()}")


def attend_kept(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, row_table: torch.Tensor,
                row_pages: torch.Tensor, last_page_len: torch.Tensor, n_sink: torch.Tensor, n_slots: torch.Tensor,
                recall: torch.Tensor, phase: int, scale: float, page_size: int) -> Partials:
    check_device(q, k_cache, v_cache, row_table, row_pages, last_page_len, n_sink, n_slots, recall)
    check_index_vectors(row_pages=row_pages, last_page_len=last_page_len, n_sink=n_sink, n_slots=n_slots)
    group = check_split_args(q, k_cache, recall, row_table.shape[0])
    _check_rows(q, k_cache, v_cache)
    if not recall.is_contiguous() or row_table.stride(1) != 1:
        raise ValueError("recall and the rows of row_table must be contiguous")
    batch, num_q_heads, head_dim = q.shape
    heads, width = k_cache.shape[1], row_table.shape[1]
    splits = num_splits(batch, heads, width, q.device)
    m = empty(batch, num_q_heads, splits, dtype=torch.float32, device=q.device)
    l = empty(batch, num_q_heads, splits, dtype=torch.float32, device=q.device)
    acc = empty(batch, num_q_heads, splits, head_dim, dtype=torch.float32, device=q.device)
    if batch:
        _attend_kept_kernel[(batch, heads, splits)](
            q, k_cache, v_cache, row_table, row_pages, last_page_len, n_sink, n_slots, recall, m, l, acc,
            scale * _LOG2E, triton.cdiv(width, splits), phase,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
            row_table.stride(0),
            H=heads, K=recall.shape[2], G=group, G_PAD=max(_MIN_DOT, triton.next_power_of_2(group)), D=head_dim,
            PAGE_SIZE=page_size, PAGE_TILE=max(_MIN_DOT, page_size), NUM_SPLITS=splits,
            DOT_F32=q.dtype == torch.float32 or interpret_mode(),
        )
    return Partials(m, l, acc)


def attend_recalled(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_pages: torch.Tensor,
                    n_slots: torch.Tensor, recall: torch.Tensor, phase: int, scale: float, page_size: int,
                    kept: Partials) -> torch.Tensor:
    check_device(q, k_cache, v_cache, slot_pages, n_slots, recall, *kept)
    check_index_vectors(n_slots=n_slots)
    group = check_split_args(q, k_cache, recall, slot_pages.shape[0])
    _check_rows(q, k_cache, v_cache)
    if not recall.is_contiguous() or slot_pages.stride(1) != 1 or slot_pages.shape[1] < recall.shape[2]:
        raise ValueError(f"slot_pages [B, >= {recall.shape[2]}] and recall must be contiguous rows")
    batch, num_q_heads, head_dim = q.shape
    splits = kept.m.shape[2]
    if kept.m.shape != (batch, num_q_heads, splits) or kept.acc.shape != (batch, num_q_heads, splits, head_dim) \
            or not all(t.is_contiguous() for t in kept):
        raise ValueError("kept must be attend_kept's partials of the same q")
    o = empty(batch, num_q_heads, head_dim, dtype=q.dtype, device=q.device)
    if batch:
        heads, k = k_cache.shape[1], recall.shape[2]
        _attend_recalled_kernel[(batch, heads)](
            q, k_cache, v_cache, slot_pages, n_slots, recall, *kept, o, scale * _LOG2E, phase,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
            slot_pages.stride(0), o.stride(0), o.stride(1),
            H=heads, K=k, K_PAD=triton.next_power_of_2(k), G=group, G_PAD=max(_MIN_DOT, triton.next_power_of_2(group)),
            D=head_dim, PAGE_SIZE=page_size, BLOCK=max(_RECALLED_BLOCK, page_size), NUM_SPLITS=splits,
            SPLITS_PAD=triton.next_power_of_2(splits), DOT_F32=q.dtype == torch.float32 or interpret_mode(),
            num_warps=_RECALLED_WARPS,
        )
    return o


def attend_pages(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, row_table: torch.Tensor,
                 row_pages: torch.Tensor, last_page_len: torch.Tensor, scale: float, page_size: int,
                 tickets: torch.Tensor, splits: int | None = None) -> torch.Tensor:
    check_device(q, k_cache, v_cache, row_table, row_pages, last_page_len, tickets)
    check_index_vectors(row_pages=row_pages, last_page_len=last_page_len)
    group = check_pages_args(q, k_cache, row_table, tickets)
    _check_rows(q, k_cache, v_cache)
    if row_table.stride(1) != 1:
        raise ValueError("the rows of row_table must be contiguous")
    batch, num_q_heads, head_dim = q.shape
    heads, width = k_cache.shape[1], row_table.shape[1]
    splits = pages_splits(batch, heads, width, q.device) if splits is None else max(1, min(splits, width))
    splits = triton.cdiv(width, triton.cdiv(width, splits))  # no split without pages in a full row
    o = empty(batch, num_q_heads, head_dim, dtype=q.dtype, device=q.device)
    if batch:
        # poisoned under the tests too: a partial no program stored would reach the merge as NaN
        m = empty(batch, num_q_heads, splits, dtype=torch.float32, device=q.device)
        l = empty(batch, num_q_heads, splits, dtype=torch.float32, device=q.device)
        acc = empty(batch, num_q_heads, splits, head_dim, dtype=torch.float32, device=q.device)
        _attend_pages_kernel[(batch, heads, splits)](
            q, k_cache, v_cache, row_table, row_pages, last_page_len, m, l, acc, tickets, o,
            scale * _LOG2E, triton.cdiv(width, splits),
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
            row_table.stride(0), o.stride(0), o.stride(1),
            H=heads, G=group, G_PAD=max(_MIN_DOT, triton.next_power_of_2(group)), G_POW=triton.next_power_of_2(group),
            D=head_dim, PAGE_SIZE=page_size, TILE=max(_MIN_DOT, page_size * _PAGES_AT_ONCE), NUM_SPLITS=splits,
            SPLITS_PAD=triton.next_power_of_2(splits), DOT_F32=q.dtype == torch.float32 or interpret_mode(),
            num_warps=_PAGES_WARPS,
        )
    return o
