"""Torch reference for sparse_decode_attention (see docs/kernels.md, section sparse_attention)."""

from __future__ import annotations

import torch


def naive_sparse_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    num_pages: torch.Tensor,
    last_page_len: torch.Tensor,
    scale: float,
    page_size: int,
) -> torch.Tensor:
    batch, num_q_heads, _ = q.shape
    group = num_q_heads // k_cache.shape[1]
    o = torch.zeros_like(q)
    offsets = torch.arange(page_size, device=q.device)
    for b in range(batch):
        n = int(num_pages[b])
        if n == 0:
            continue
        pages = page_table[b, :n].long()
        n_tokens = (n - 1) * page_size + int(last_page_len[b])
        rows = (pages[:, None] * page_size + offsets).flatten()[:n_tokens]
        k = k_cache[rows].float()  # [N, H, D]
        v = v_cache[rows].float()
        for hq in range(num_q_heads):
            h = hq // group
            p = torch.softmax(k[:, h] @ q[b, hq].float() * scale, dim=0)
            o[b, hq] = (p @ v[:, h]).to(q.dtype)
    return o
