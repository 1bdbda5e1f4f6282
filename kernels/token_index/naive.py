"""Torch reference for head_token_index (see docs/kernels.md, section token_index)."""

from __future__ import annotations

import torch


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
