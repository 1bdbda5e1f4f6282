"""Torch reference for recall_pages: copy selected (page, head) chunks from the HND host arena into NHD GPU pages."""

from __future__ import annotations

import torch


def naive_recall_pages(
    host_layer: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    src: torch.Tensor,
    head: torch.Tensor,
    dst: torch.Tensor,
    valid: torch.Tensor,
    page_size: int,
) -> None:
    """For each valid i: rows dst[i]*p .. +p, head head[i] of k_cache / v_cache <- host_layer[src[i], head[i], 0/1]."""
    p = page_size
    for s, h, d, ok in zip(src.tolist(), head.tolist(), dst.tolist(), valid.tolist()):
        if ok:
            k_cache[d * p : (d + 1) * p, h].copy_(host_layer[s, h, 0])
            v_cache[d * p : (d + 1) * p, h].copy_(host_layer[s, h, 1])
