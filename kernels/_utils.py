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
