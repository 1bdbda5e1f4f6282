"""Test helpers for the kernels: device choice, NaN poisoning, one comparison function."""

from __future__ import annotations

import contextlib

import torch

from . import _alloc


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@contextlib.contextmanager
def poisoned_outputs():
    """Every output a kernel wrapper allocates starts as NaN (ints: a large negative sentinel)."""
    old, _alloc.POISON = _alloc.POISON, True
    try:
        yield
    finally:
        _alloc.POISON = old


def nan_like(t: torch.Tensor) -> torch.Tensor:
    return torch.full_like(t, float("nan"))


def assert_close(name: str, ref: torch.Tensor, out: torch.Tensor, *, atol: float = 1e-5, rtol: float = 1e-5) -> None:
    """Exact shape/dtype, no NaN anywhere in `out`, and elementwise closeness to `ref`."""
    assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    assert out.dtype == ref.dtype, f"{name}: dtype {out.dtype} != {ref.dtype}"
    if out.is_floating_point():
        assert not torch.isnan(out).any(), f"{name}: {int(torch.isnan(out).sum())} NaN elements (unwritten output?)"
        torch.testing.assert_close(out.float().cpu(), ref.float().cpu(), atol=atol, rtol=rtol, msg=lambda m: f"{name}: {m}")
    else:
        mism = (out.cpu() != ref.cpu()).sum().item()
        assert mism == 0, f"{name}: {mism} of {ref.numel()} elements differ"
