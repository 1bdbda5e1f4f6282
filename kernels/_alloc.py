"""Output allocation for kernel wrappers. Tests turn on poisoning so an unwritten element shows up as NaN."""

from __future__ import annotations

import torch

POISON = False
_INT_POISON = -(2**30) + 7


def empty(*shape: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    out = torch.empty(*shape, dtype=dtype, device=device)
    if POISON:
        out.fill_(float("nan") if out.is_floating_point() else _INT_POISON if dtype != torch.bool else True)
    return out
