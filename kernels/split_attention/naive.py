"""Torch reference for attend_kept / attend_recalled / attend_pages (see docs/kernels.md, section split_attention)."""

from __future__ import annotations

from typing import NamedTuple

import torch

_LOG2E = 1.4426950408889634


class Partials(NamedTuple):
    """Unnormalised softmax partials per (row, query head, split), in fp32 and the log2 domain: the running max m,
    the sum l of 2^(s - m) and the sum acc of 2^(s - m) * v. A split with no token holds m = -inf, l = 0, acc = 0."""

    m: torch.Tensor  # [B, Hq, S]
    l: torch.Tensor  # [B, Hq, S]
    acc: torch.Tensor  # [B, Hq, S, D]


def check_split_args(q: torch.Tensor, k_cache: torch.Tensor, recall: torch.Tensor, n_rows: int) -> int:
    """The GQA group; refuses shapes the two launches would read out of bounds."""
    batch, num_q_heads, _ = q.shape
    heads = k_cache.shape[1]
    if num_q_heads % heads:
        raise ValueError(f"{num_q_heads} query heads are not a multiple of {heads} KV heads")
    if recall.dim() != 3 or recall.shape[:2] != (batch, heads) or n_rows != batch:
        raise ValueError(f"recall must be [B={batch}, H={heads}, k] for {n_rows} table rows, got {tuple(recall.shape)}")
    return num_q_heads // heads


def check_pages_args(q: torch.Tensor, k_cache: torch.Tensor, row_table: torch.Tensor, tickets: torch.Tensor) -> int:
    """attend_pages' GQA group; refuses shapes it would read or count out of bounds."""
    batch, num_q_heads, _ = q.shape
    heads = k_cache.shape[1]
    if num_q_heads % heads:
        raise ValueError(f"{num_q_heads} query heads are not a multiple of {heads} KV heads")
    if row_table.dim() != 2 or row_table.shape[0] != batch:
        raise ValueError(f"row_table must be [B={batch}, W], got {tuple(row_table.shape)}")
    if tickets.dtype != torch.int32 or not tickets.is_contiguous() or tickets.numel() < batch * heads:
        raise ValueError(f"tickets must be a contiguous int32 tensor of at least B * H = {batch * heads} counters, got "
                         f"{tickets.dtype} {tuple(tickets.shape)}")
    return num_q_heads // heads


def _partials(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor, scale: float) -> tuple:
    """(m, l, acc) [Hq], [Hq], [Hq, D] of one row's query heads q [Hq, D] over the tokens k, v [N, H, D] that
    keep [H, N] marks for each KV head, in the log2 domain (a head with none: -inf, 0, 0)."""
    group = q.shape[0] // k.shape[1]
    keep = keep.repeat_interleave(group, 0)  # [Hq, N]
    kq, vq = k.float().repeat_interleave(group, 1), v.float().repeat_interleave(group, 1)  # [N, Hq, D]
    s = torch.einsum("hd,nhd->hn", q.float(), kq) * (scale * _LOG2E)
    s = s.masked_fill(~keep, float("-inf"))
    m = s.max(1).values if s.shape[1] else torch.full((q.shape[0],), float("-inf"), device=q.device)
    w = torch.exp2(s - torch.where(m == float("-inf"), 0.0, m)[:, None]).masked_fill(~keep, 0.0)
    vq = vq.masked_fill(~keep.T[:, :, None], 0.0)  # what is not kept is never read, NaN or not
    return m, w.sum(1), torch.einsum("hn,nhd->hd", w, vq)


def _page_rows(pages: torch.Tensor, page_size: int, n_tokens: int) -> torch.Tensor:
    return (pages.long()[:, None] * page_size + torch.arange(page_size, device=pages.device)).flatten()[:n_tokens]


def naive_attend_kept(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, row_table: torch.Tensor,
                      row_pages: torch.Tensor, last_page_len: torch.Tensor, n_sink: torch.Tensor,
                      n_slots: torch.Tensor, recall: torch.Tensor, phase: int, scale: float,
                      page_size: int) -> Partials:
    """The partials of each (row b, query head hq) over the pages row_table[b, :row_pages[b]] (the last holding
    last_page_len[b] tokens), without the selection slots s < n_slots[b] (table entry n_sink[b] + s) of KV head
    hq // G whose recall[b, h, s] == phase: those are being recalled and read only by attend_recalled. One split."""
    check_split_args(q, k_cache, recall, row_table.shape[0])
    batch, num_q_heads, head_dim = q.shape
    p, k = page_size, recall.shape[2]
    m = torch.full((batch, num_q_heads, 1), float("-inf"), dtype=torch.float32, device=q.device)
    l = torch.zeros_like(m)
    acc = torch.zeros(batch, num_q_heads, 1, head_dim, dtype=torch.float32, device=q.device)
    for b in range(batch):
        n, first, filled = int(row_pages[b]), int(n_sink[b]), min(int(n_slots[b]), k)
        if n == 0:
            continue
        rows = _page_rows(row_table[b, :n], p, (n - 1) * p + int(last_page_len[b]))
        keep = torch.ones(k_cache.shape[1], n, dtype=torch.bool, device=q.device)  # per (head, page)
        keep[:, first:first + filled] = recall[b, :, :filled] != phase
        keep = keep.repeat_interleave(p, 1)[:, :rows.shape[0]]
        m[b, :, 0], l[b, :, 0], acc[b, :, 0] = _partials(q[b], k_cache[rows], v_cache[rows], keep, scale)
    return Partials(m, l, acc)


def naive_attend_recalled(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_pages: torch.Tensor,
                          n_slots: torch.Tensor, recall: torch.Tensor, phase: int, scale: float, page_size: int,
                          kept: Partials) -> torch.Tensor:
    """o [B, Hq, D] in q's dtype: the softmax attention of each (row b, query head hq) over the tokens of `kept`
    (attend_kept's partials) and the full pages slot_pages[b, s] of the slots s < n_slots[b] of KV head hq // G with
    recall[b, h, s] == phase. A row with no token outputs zeros."""
    check_split_args(q, k_cache, recall, slot_pages.shape[0])
    p = page_size
    o = torch.zeros_like(q)
    for b in range(q.shape[0]):
        filled = min(int(n_slots[b]), recall.shape[2])
        rows = _page_rows(slot_pages[b, :filled], p, filled * p)
        keep = (recall[b, :, :filled] == phase).repeat_interleave(p, 1)
        m_r, l_r, acc_r = _partials(q[b], k_cache[rows], v_cache[rows], keep, scale)
        m = torch.cat([kept.m[b], m_r[:, None]], 1)  # [Hq, S + 1]
        l = torch.cat([kept.l[b], l_r[:, None]], 1)
        acc = torch.cat([kept.acc[b], acc_r[:, None]], 1)
        top = m.max(1).values
        w = torch.exp2(m - torch.where(top == float("-inf"), 0.0, top)[:, None])
        total = (w * l).sum(1)
        out = (w[:, :, None] * acc).sum(1) / torch.where(total > 0, total, 1.0)[:, None]
        o[b] = out.to(q.dtype)
    return o


def naive_attend_pages(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, row_table: torch.Tensor,
                       row_pages: torch.Tensor, last_page_len: torch.Tensor, scale: float, page_size: int,
                       tickets: torch.Tensor, splits: int | None = None) -> torch.Tensor:
    """o [B, Hq, D] in q's dtype: the softmax attention of each (row b, query head hq) over the pages
    row_table[b, :row_pages[b]] of KV head hq // G (the last holding last_page_len[b] tokens); a row with no page
    outputs zeros. tickets (attend_pages' counters, zero between calls) and splits (its programs a row and KV head)
    change nothing here."""
    check_pages_args(q, k_cache, row_table, tickets)
    o = torch.zeros_like(q)
    for b in range(q.shape[0]):
        n = int(row_pages[b])
        if n == 0:
            continue
        rows = _page_rows(row_table[b, :n], page_size, (n - 1) * page_size + int(last_page_len[b]))
        keep = torch.ones(k_cache.shape[1], rows.shape[0], dtype=torch.bool, device=q.device)
        m, l, acc = _partials(q[b], k_cache[rows], v_cache[rows], keep, scale)
        o[b] = (acc / torch.where(l > 0, l, 1.0)[:, None]).to(q.dtype)
    return o
