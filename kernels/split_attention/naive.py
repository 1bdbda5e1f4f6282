"""Torch reference for attend_kept / attend_recalled (see docs/kernels.md, section split_attention)."""

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


def _partial(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple:
    """(m, l, acc) of q [D] over k, v [N, D] in the log2 domain."""
    if k.shape[0] == 0:
        return float("-inf"), 0.0, torch.zeros_like(q, dtype=torch.float32)
    s = (k.float() @ q.float()) * (scale * _LOG2E)
    m = s.max()
    w = torch.exp2(s - m)
    return m, w.sum(), w @ v.float()


def naive_attend_kept(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, row_table: torch.Tensor,
                      row_pages: torch.Tensor, last_page_len: torch.Tensor, n_sink: torch.Tensor,
                      n_slots: torch.Tensor, recall: torch.Tensor, phase: int, scale: float,
                      page_size: int) -> Partials:
    """The partials of each (row b, query head hq) over the pages row_table[b, :row_pages[b]] (the last holding
    last_page_len[b] tokens), without the selection slots s < n_slots[b] (table entry n_sink[b] + s) of KV head
    hq // G whose recall[b, h, s] == phase: those are being recalled and read only by attend_recalled. One split."""
    group = check_split_args(q, k_cache, recall, row_table.shape[0])
    batch, num_q_heads, head_dim = q.shape
    p, k = page_size, recall.shape[2]
    m = torch.full((batch, num_q_heads, 1), float("-inf"), dtype=torch.float32, device=q.device)
    l = torch.zeros_like(m)
    acc = torch.zeros(batch, num_q_heads, 1, head_dim, dtype=torch.float32, device=q.device)
    offsets = torch.arange(p, device=q.device)
    for b in range(batch):
        n, first, filled = int(row_pages[b]), int(n_sink[b]), min(int(n_slots[b]), k)
        for h in range(k_cache.shape[1]):
            keep = [i for i in range(n) if not (first <= i < first + filled and int(recall[b, h, i - first]) == phase)]
            rows = [row_table[b, i].long() * p + offsets[: int(last_page_len[b]) if i == n - 1 else p] for i in keep]
            rows = torch.cat(rows) if rows else offsets[:0]
            for hq in range(h * group, (h + 1) * group):
                m[b, hq, 0], l[b, hq, 0], acc[b, hq, 0] = _partial(q[b, hq], k_cache[rows, h], v_cache[rows, h],
                                                                   scale)
    return Partials(m, l, acc)


def naive_attend_recalled(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_pages: torch.Tensor,
                          n_slots: torch.Tensor, recall: torch.Tensor, phase: int, scale: float, page_size: int,
                          kept: Partials) -> torch.Tensor:
    """o [B, Hq, D] in q's dtype: the softmax attention of each (row b, query head hq) over the tokens of `kept`
    (attend_kept's partials) and the full pages slot_pages[b, s] of the slots s < n_slots[b] of KV head hq // G with
    recall[b, h, s] == phase. A row with no token outputs zeros."""
    group = check_split_args(q, k_cache, recall, slot_pages.shape[0])
    p = page_size
    o = torch.zeros_like(q)
    offsets = torch.arange(p, device=q.device)
    for b in range(q.shape[0]):
        for hq in range(q.shape[1]):
            h = hq // group
            slots = (recall[b, h, :int(n_slots[b])] == phase).nonzero().flatten().tolist()
            rows = [slot_pages[b, s].long() * p + offsets for s in slots]
            rows = torch.cat(rows) if rows else offsets[:0]
            m_r, l_r, acc_r = _partial(q[b, hq], k_cache[rows, h], v_cache[rows, h], scale)
            m = torch.cat([kept.m[b, hq], torch.tensor([m_r], dtype=torch.float32, device=q.device)])
            l = torch.cat([kept.l[b, hq], torch.tensor([l_r], dtype=torch.float32, device=q.device)])
            acc = torch.cat([kept.acc[b, hq], acc_r[None]])
            top = m.max()
            if top == float("-inf"):
                continue
            w = torch.exp2(m - top)
            o[b, hq] = ((w @ acc) / (w @ l)).to(q.dtype)
    return o
