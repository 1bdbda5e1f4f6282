"""Torch reference for head_token_index (see docs/kernels.md, section token_index)."""

from __future__ import annotations

import torch


def check_q_rows(q: torch.Tensor | None, q_rows: torch.Tensor | None, B: int, H: int) -> tuple[int, int]:
    """(G, D) of q [B, H * G, D] and q_rows [B * H, G, D] (contiguous, q's dtype), both given or neither; (1, 1)
    without them."""
    if (q is None) != (q_rows is None):
        raise ValueError("q and q_rows come together")
    if q is None:
        return 1, 1
    assert q.dim() == 3 and q.shape[0] == B and q.shape[1] % H == 0, (tuple(q.shape), B, H)
    G, D = q.shape[1] // H, q.shape[2]
    assert q_rows.shape == (B * H, G, D) and q_rows.is_contiguous() and q_rows.dtype == q.dtype
    return G, D


def naive_head_token_index(slots: torch.Tensor, req_slots: torch.Tensor, row_table: torch.Tensor,
                           n_sink: torch.Tensor, n_slots: torch.Tensor, slot_pages: torch.Tensor,
                           row_tokens: torch.Tensor, row_start: torch.Tensor, page_size: int,
                           out: torch.Tensor, q: torch.Tensor | None = None,
                           q_rows: torch.Tensor | None = None) -> None:
    """Head h of row b attends to row_table[b], except that entries n_sink[b] .. n_sink[b] + n_slots[b] - 1 hold
    the GPU pages slot_pages[b, s] of head h's slots ordered by the logical page slot s holds
    (slots[req_slots[b], h, s]), empty slots (-1) last, ties by slot index. For its n = row_tokens[b] tokens
    (row_start: their exclusive prefix sum), t < n: out[H * row_start[b] + h * n + t] = (pages[t // p] * p + t % p)
    * H + h. Nothing else is written. Given q [B, H * G, D], also q_rows [B * H, G, D] = q's G query heads of each
    (row, KV head), the kernel's rows."""
    H, k = slots.shape[1], slots.shape[2]
    check_q_rows(q, q_rows, req_slots.shape[0], H)
    if q is not None:
        q_rows.copy_(q.reshape(q_rows.shape))
    p = page_size
    for b, r in enumerate(req_slots.tolist()):
        first, count, n = int(n_sink[b]), int(n_slots[b]), int(row_tokens[b])
        t = torch.arange(n, device=out.device)
        for h in range(H):
            pages = row_table[b].clone()
            held = slots[r, h].tolist()
            order = sorted(range(k), key=lambda s: (held[s] < 0, held[s], s))
            for m in range(count):
                pages[first + m] = slot_pages[b, order[m]]
            rows = pages[t // p].long() * p + t % p
            start = H * int(row_start[b]) + h * n
            out[start:start + n] = (rows * H + h).to(out.dtype)
