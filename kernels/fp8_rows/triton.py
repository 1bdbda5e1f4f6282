"""FP8 host pages in Triton: the row codec the offload, recall and page-copy kernels inline (quantize_tile,
dequantize_tile), and two kernels over plain tensors that test it against the torch reference.

The rounding to e4m3 is done in float32 before the cast, so the cast itself is exact: Triton's interpreter rounds
some values wrongly when rounding carries into the exponent (127.2 -> 64), while a GPU's cvt would be right. The
float32 rounding adds 1.5 * 2**23 times the value's e4m3 quantum and takes it away again (round to nearest even,
exact in IEEE float32 arithmetic, as the interpreter's numpy and the GPU both do it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._utils import check_device
from .naive import EXP_MAX, EXP_MIN, FP8_DTYPE

_E_MIN = tl.constexpr(EXP_MIN)  # globals a jitted function reads must be constexpr
_E_MAX = tl.constexpr(EXP_MAX)


@triton.jit
def pow2(e):
    """2.0 ** e in float32 for int32 e in [-126, 127], built from its bits (exact on every device)."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def quantize_tile(x):
    """x float32 [R, D] -> (q float32 [R, D] on the e4m3 grid, e int32 [R]) with x ~= q * 2**e, as
    naive_quantize_rows; cast q to tl.float8e4nv to store it (exactly)."""
    amax = tl.max(tl.abs(x), axis=1)
    bits = amax.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127 - 8 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    e = tl.minimum(tl.maximum(tl.where(amax > 0, e, _E_MIN), _E_MIN), _E_MAX)
    y = x * pow2(-e)[:, None]
    a = tl.abs(y)
    # e4m3's quantum at a: 2**(max(exponent(a), -6) - 3) (below 2**-6 the subnormals' 2**-9)
    ea = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    c = 1.5 * pow2(tl.maximum(ea, -6) - 3 + 23)
    r = (a + c) - c
    sign = y.to(tl.int32, bitcast=True) & -2147483648
    q = (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    return q, e


@triton.jit
def dequantize_tile(q, e):
    """q [R, D] (e4m3 or float32), e [R] int -> q * 2**e in float32, exact."""
    return q.to(tl.float32) * pow2(e.to(tl.int32))[:, None]


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, e_ptr, N, D, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_D)
    m = (r < N)[:, None] & (d < D)[None, :]
    x = tl.load(x_ptr + r[:, None] * D + d[None, :], mask=m, other=0.0).to(tl.float32)
    q, e = quantize_tile(x)
    tl.store(q_ptr + r[:, None] * D + d[None, :], q.to(tl.float8e4nv), mask=m)
    tl.store(e_ptr + r, e.to(tl.int8), mask=r < N)


@triton.jit
def _dequantize_rows_kernel(q_ptr, e_ptr, out_ptr, N, D, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_D)
    m = (r < N)[:, None] & (d < D)[None, :]
    q = tl.load(q_ptr + r[:, None] * D + d[None, :], mask=m, other=0.0)
    e = tl.load(e_ptr + r, mask=r < N, other=0)
    tl.store(out_ptr + r[:, None] * D + d[None, :], dequantize_tile(q, e).to(out_ptr.dtype.element_ty), mask=m)


def _rows(t: torch.Tensor) -> tuple[int, int]:
    if t.dim() < 1 or not t.is_contiguous():
        raise ValueError(f"rows must be a contiguous tensor [..., D], got {tuple(t.shape)}")
    return t.numel() // max(t.shape[-1], 1), t.shape[-1]


def quantize_rows(x: torch.Tensor, q: torch.Tensor, e: torch.Tensor) -> None:
    """q [..., D] e4m3 and e [...] int8 <- naive_quantize_rows(x), in place."""
    check_device(x, q, e)
    N, D = _rows(x)
    if q.shape != x.shape or q.dtype != FP8_DTYPE or e.shape != x.shape[:-1] or e.dtype != torch.int8:
        raise ValueError(f"q must be {tuple(x.shape)} {FP8_DTYPE} and e {tuple(x.shape[:-1])} int8")
    _rows(q), _rows(e.unsqueeze(-1))
    if N:
        _quantize_rows_kernel[(triton.cdiv(N, 16),)](x, q, e, N, D, BLOCK_R=16, BLOCK_D=triton.next_power_of_2(D))


def dequantize_rows(q: torch.Tensor, e: torch.Tensor, out: torch.Tensor) -> None:
    """out [..., D] <- naive_dequantize_rows(q, e, out.dtype), in place."""
    check_device(q, e, out)
    N, D = _rows(q)
    if q.dtype != FP8_DTYPE or e.shape != q.shape[:-1] or e.dtype != torch.int8 or out.shape != q.shape:
        raise ValueError(f"q must be e4m3, e {tuple(q.shape[:-1])} int8 and out {tuple(q.shape)}")
    _rows(e.unsqueeze(-1)), _rows(out)
    if N:
        _dequantize_rows_kernel[(triton.cdiv(N, 16),)](q, e, out, N, D, BLOCK_R=16,
                                                       BLOCK_D=triton.next_power_of_2(D))
