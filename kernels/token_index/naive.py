"""Torch references for head_pages and head_token_index (see docs/kernels.md, section token_index)."""

from __future__ import annotations

import torch


def naive_head_pages(slots: torch.Tensor, req_slots: torch.Tensor, row_table: torch.Tensor, n_sink: torch.Tensor,
                     n_slots: torch.Tensor, slot_pages: torch.Tensor) -> torch.Tensor:
    """[B, H, W] int32: row_table[b] for every head h, except that entries n_sink[b] .. n_sink[b] + n_slots[b] - 1
    hold the GPU pages slot_pages[b, s] of head h's slots ordered by the logical page slot s holds
    (slots[req_slots[b], h, s]), empty slots (-1) last, ties by slot index."""
    H, k = slots.shape[1], slots.shape[2]
    out = row_table[:, None, :].repeat(1, H, 1).to(torch.int32)
    for b, r in enumerate(req_slots.tolist()):
        first, count = int(n_sink[b]), int(n_slots[b])
        for h in range(H):
            held = slots[r, h].tolist()
            order = sorted(range(k), key=lambda s: (held[s] < 0, held[s], s))
            for m in range(count):
                out[b, h, first + m] = slot_pages[b, order[m]]
    return out


def naive_head_token_index(head_pages: torch.Tensor, row_tokens: torch.Tensor, row_start: torch.Tensor,
                           page_size: int, out: torch.Tensor) -> None:
    """For row b with n = row_tokens[b] tokens per KV head (row_start: their exclusive prefix sum) and each
    head h, token t < n: out[H * row_start[b] + h * n + t] = (head_pages[b, h, t // p] * p + t % p) * H + h.
    Nothing else is written."""
    B, H, _ = head_pages.shape
    p = page_size
    for b in range(B):
        n = int(row_tokens[b])
        t = torch.arange(n, device=out.device)
        for h in range(H):
            rows = head_pages[b, h, t // p].long() * p + t % p
            start = H * int(row_start[b]) + h * n
            out[start:start + n] = (rows * H + h).to(out.dtype)
