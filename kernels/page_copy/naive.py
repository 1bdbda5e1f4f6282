"""Torch references for the page copies between the HND host arena and NHD token rows on the GPU (SGLang's pool
buffers, staging pages, the engine's pages): whole pages of every KV head, K and V."""

from __future__ import annotations

import torch


def naive_pages_from_host(host_layer: torch.Tensor, host_pages: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          rows: torch.Tensor) -> None:
    """k[rows[i * p + t], h] = host_layer[host_pages[i], h, 0, t] and v likewise from [..., 1, ...], for every page i,
    head h and token t; host_layer [N, H, 2, p, D], k / v [T, H, D], rows [n * p]."""
    chunk = host_layer[host_pages.long().cpu()].to(k.device)  # [n, H, 2, p, D]
    idx = rows.long().to(k.device)
    for i, out in enumerate((k, v)):
        out[idx] = chunk[:, :, i].transpose(1, 2).reshape(-1, *out.shape[1:]).to(out.dtype)


def naive_pages_to_host(k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor, host_layer: torch.Tensor,
                        host_pages: torch.Tensor) -> None:
    """host_layer[host_pages[i], h, 0, t] = k[rows[i * p + t], h] and [..., 1, ...] from v: the inverse copy."""
    p, H, D = host_layer.shape[3], host_layer.shape[1], host_layer.shape[-1]
    dst = host_pages.long().cpu()
    idx = rows.long().to(k.device)
    for i, src in enumerate((k, v)):
        host_layer[dst, :, i] = src[idx].view(-1, p, H, D).transpose(1, 2).to("cpu", host_layer.dtype)
