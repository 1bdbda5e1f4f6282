"""Torch reference for fp8_linear: y = x @ W^T + bias, W stored as e4m3 rows times one power-of-two scale a row
(freekv_kernels.fp8_rows' codec: exact but for the one rounding to e4m3)."""

from __future__ import annotations

import torch

from ..fp8_rows import FP8_DTYPE


def check_fp8_linear_args(x: torch.Tensor, w: torch.Tensor, e: torch.Tensor, bias: torch.Tensor | None) -> None:
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"x must be [M, K] and w [N, K], got {tuple(x.shape)} and {tuple(w.shape)}")
    if w.dtype != FP8_DTYPE:
        raise ValueError(f"w must be {FP8_DTYPE} rows (fp8_rows.quantize_rows), got {w.dtype}")
    if e.shape != (w.shape[0],) or e.dtype not in (torch.int8, torch.int32):
        raise ValueError(f"e must hold one int8 or int32 exponent per row of w ({w.shape[0]}), got {e.dtype} "
                         f"{tuple(e.shape)}")
    if bias is not None and bias.shape != (w.shape[0],):
        raise ValueError(f"bias must be [{w.shape[0]}], got {tuple(bias.shape)}")
    if not e.is_contiguous() or (bias is not None and not bias.is_contiguous()):
        raise ValueError("e and bias must be contiguous (the kernel reads them as vectors)")


def naive_fp8_linear(x: torch.Tensor, w: torch.Tensor, e: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """y [M, N] in x's dtype: x [M, K] times the rows w [N, K] (e4m3) scaled by 2**e [N], plus bias [N]; fp32 sums."""
    check_fp8_linear_args(x, w, e, bias)
    y = x.float() @ w.float().T * torch.exp2(e.float())
    return (y if bias is None else y + bias.float()).to(x.dtype)
