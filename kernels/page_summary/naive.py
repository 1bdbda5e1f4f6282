"""Torch reference for page_summary: per-head elementwise min / max of the keys of GPU pages."""

from __future__ import annotations

import torch


def naive_page_summary(
    k_cache: torch.Tensor,
    pages: torch.Tensor,
    dst: torch.Tensor,
    valid: torch.Tensor,
    summaries: torch.Tensor,
    page_size: int,
) -> None:
    """For each valid i: summaries[dst[i], :, 0 / 1] = min / max over the keys of GPU page pages[i]."""
    p = page_size
    for g, s, ok in zip(pages.tolist(), dst.tolist(), valid.tolist()):
        if ok:
            keys = k_cache[g * p : (g + 1) * p]  # [p, H, D]
            summaries[s, :, 0] = keys.amin(dim=0)
            summaries[s, :, 1] = keys.amax(dim=0)
