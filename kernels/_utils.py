"""Helpers shared by the Triton wrappers."""

from __future__ import annotations

import os

import torch


def interpret_mode() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_device(*tensors: torch.Tensor) -> None:
    """Triton runs on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1."""
    for t in tensors:
        if t.device.type == "cpu" and not interpret_mode() and not t.is_pinned():
            raise ValueError("CPU tensors need TRITON_INTERPRET=1 (or pinned host memory on a CUDA machine)")


def check_index_vectors(**tensors: torch.Tensor) -> None:
    """Index and mask vectors are read as dense 1-D arrays: refuse views with other strides (an expanded
    [B, 1, k] index flattens to a stride-0 view, and the kernel would read past its storage)."""
    for name, t in tensors.items():
        if t.dim() != 1 or (t.numel() > 1 and t.stride(0) != 1):
            raise ValueError(f"{name} must be a contiguous 1-D tensor, got shape {tuple(t.shape)} strides {t.stride()}")


def capped_grid(items: int, programs: int) -> tuple[int]:
    """A 1-D grid over `items` work items: one program per item, or with programs > 0 at most that many, each
    striding over the items (a kernel beside the model's GEMMs then holds a few SMs, not one CTA per item)."""
    return (min(items, programs) if programs > 0 else items,)
