"""Triton fp8_linear: a small-batch GEMM that reads its weight as e4m3, half the bytes of bf16 (the early lane's query
projection re-reads W_q every layer: at one request its bytes, not its FLOPs, are the cost).

Grid (N / BN, M / BM): each program streams BN rows of W over K in BK steps, widening e4m3 to x's dtype (exact), then
scales each output column by its row's 2**e and adds the bias. Rows of x up to `Tiles.gemv_rows` take a CUDA-core
path (every row of x in one program: products summed in fp32 registers, one reduction at the end), more rows a
tensor-core dot with fp32 sums. Small BN so that a few rows of a large W spread over every SM.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .._alloc import empty
from .._utils import check_device, interpret_mode
from ..fp8_rows.triton import pow2
from .naive import check_fp8_linear_args


@dataclass(frozen=True)
class Tiles:
    """Launch shape; benchmarks/fp8_linear.py sweeps it. tl.dot needs >= 16 rows, columns and K a tile."""
    bn: int = 32
    bk: int = 512
    stages: int = 4
    warps: int = 4
    gemv_bn: int = 16
    gemv_bk: int = 512
    gemv_stages: int = 4
    gemv_warps: int = 4
    gemv_rows: int = 1  # x with at most this many rows takes the CUDA-core path (its tile's registers grow with them)

    def __post_init__(self) -> None:
        for name in ("bn", "bk", "gemv_bn", "gemv_bk", "warps", "gemv_warps"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"Tiles.{name} must be a power of two, got {v}")
        if min(self.bn, self.bk) < 16:
            raise ValueError(f"the dot path's tiles need >= 16 columns and K (tl.dot), got bn {self.bn}, bk {self.bk}")
        if self.gemv_rows < 0 or min(self.stages, self.gemv_stages) < 1:
            raise ValueError(f"Tiles.gemv_rows must be >= 0 and stages >= 1, got {self.gemv_rows}, {self.stages}, "
                             f"{self.gemv_stages}")
        products = triton.next_power_of_2(self.gemv_rows) * self.gemv_bn * self.gemv_bk if self.gemv_rows else 0
        if products > 16384:  # one program holds them in registers: past this, sm_90 spills (ptxas)
            raise ValueError(f"the CUDA-core path's tile of gemv_rows x gemv_bn x gemv_bk = {products} fp32 products "
                             "exceeds 16384: fewer rows or smaller tiles")


TILES = Tiles()


@triton.jit
def _k_tiles(x_ptr, w_ptr, m, n, k, m_mask, n_mask, K, sx_m, sw_n):
    """x's rows m and W's rows n over the K columns k (zeros past their ends): both paths' step over K."""
    k_mask = k < K
    x = tl.load(x_ptr + m[:, None] * sx_m + k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
    w = tl.load(w_ptr + n[:, None] * sw_n + k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
    return x, w


@triton.jit
def _fp8_linear_kernel(x_ptr, w_ptr, e_ptr, b_ptr, y_ptr, M, N, K, sx_m, sw_n, sy_m,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr,
                       HAS_BIAS: tl.constexpr, DOT_F32: tl.constexpr, GEMV: tl.constexpr):
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    m = tl.program_id(1) * BM + tl.arange(0, BM)
    k = tl.arange(0, BK)
    n_mask, m_mask = n < N, m < M
    if GEMV:  # elementwise products of BM rows in registers, reduced over K once after the loop
        prod = tl.zeros([BM, BN, BK], tl.float32)
        for k0 in tl.range(0, K, BK, num_stages=STAGES):
            x, w = _k_tiles(x_ptr, w_ptr, m, n, k0 + k, m_mask, n_mask, K, sx_m, sw_n)
            prod += w.to(tl.float32)[None, :, :] * x.to(tl.float32)[:, None, :]
        acc = tl.sum(prod, axis=2)
    else:
        acc = tl.zeros([BM, BN], tl.float32)
        for k0 in tl.range(0, K, BK, num_stages=STAGES):
            x, w = _k_tiles(x_ptr, w_ptr, m, n, k0 + k, m_mask, n_mask, K, sx_m, sw_n)
            if DOT_F32:  # fp32 "ieee" dots for fp32 x and the interpreter, which mis-multiplies bf16
                acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
            else:
                acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    y = acc * pow2(tl.load(e_ptr + n, mask=n_mask, other=0).to(tl.int32))[None, :]
    if HAS_BIAS:
        y += tl.load(b_ptr + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + m[:, None] * sy_m + n[None, :], y.to(y_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


def fp8_linear(x: torch.Tensor, w: torch.Tensor, e: torch.Tensor, bias: torch.Tensor | None = None,
               tiles: Tiles = TILES) -> torch.Tensor:
    check_device(x, w, e, *(() if bias is None else (bias,)))
    check_fp8_linear_args(x, w, e, bias)
    if x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError(f"x and w must be contiguous in K, got strides {x.stride()} and {w.stride()}")
    M, K = x.shape
    N = w.shape[0]
    y = empty(M, N, dtype=x.dtype, device=x.device)
    if M and N:
        gemv = M <= tiles.gemv_rows  # one program holds every row of x, so W is read once
        bm, bn, bk, stages, warps = (triton.next_power_of_2(M), tiles.gemv_bn, tiles.gemv_bk, tiles.gemv_stages,
                                     tiles.gemv_warps) if gemv else (16, tiles.bn, tiles.bk, tiles.stages, tiles.warps)
        _fp8_linear_kernel[(triton.cdiv(N, bn), triton.cdiv(M, bm))](
            x, w, e, bias if bias is not None else e, y, M, N, K, x.stride(0), w.stride(0), y.stride(0),
            BM=bm, BN=bn, BK=bk, STAGES=stages, HAS_BIAS=bias is not None,
            DOT_F32=x.dtype == torch.float32 or interpret_mode(), GEMV=gemv, num_warps=warps)
    return y
