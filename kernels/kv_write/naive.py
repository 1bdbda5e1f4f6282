"""Torch reference for write_kv (see docs/kernels.md)."""

from __future__ import annotations

import torch


def naive_write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   loc: torch.Tensor) -> None:
    """k_cache[loc[b]] = k[b] and v_cache[loc[b]] = v[b] for every row b (cast to the cache's dtype)."""
    for b, row in enumerate(loc.tolist()):
        k_cache[row] = k[b].to(k_cache.dtype)
        v_cache[row] = v[b].to(v_cache.dtype)
