"""Triton head_token_index: the flat per-(row, KV head) token lists FlashInfer reads, in one launch.

Grid (B * H, cdiv(max tokens, BLOCK)); a program writes BLOCK consecutive tokens of one (row, head) list.
Shapes alone fix the grid (max tokens = resident pages * page size), so the op can be captured in a CUDA
graph; programs past a row's length exit at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._utils import check_device, check_index_vectors

BLOCK = 256


@triton.jit
def _head_token_index_kernel(pages_ptr, tokens_ptr, start_ptr, out_ptr, H, sp_b, sp_h, sp_i,
                             PAGE: tl.constexpr, BLOCK: tl.constexpr):
    bh = tl.program_id(0)
    b = bh // H
    h = bh % H
    n = tl.load(tokens_ptr + b)
    t = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    if tl.program_id(1) * BLOCK >= n:
        return
    mask = t < n
    page = tl.load(pages_ptr + b.to(tl.int64) * sp_b + h * sp_h + (t // PAGE) * sp_i, mask=mask, other=0)
    rows = page.to(tl.int64) * PAGE + t % PAGE
    start = tl.load(start_ptr + b).to(tl.int64) * H + h.to(tl.int64) * n
    tl.store(out_ptr + start + t, (rows * H + h).to(out_ptr.dtype.element_ty), mask=mask)


def head_token_index(head_pages: torch.Tensor, row_tokens: torch.Tensor, row_start: torch.Tensor,
                     page_size: int, out: torch.Tensor) -> None:
    check_device(head_pages, row_tokens, row_start, out)
    check_index_vectors(row_tokens=row_tokens, row_start=row_start, out=out)
    B, H, rp = head_pages.shape
    assert row_tokens.shape == (B,) and row_start.shape == (B,)
    if B == 0:
        return
    grid = (B * H, triton.cdiv(rp * page_size, BLOCK))
    _head_token_index_kernel[grid](head_pages, row_tokens, row_start, out, H, *head_pages.stride(),
                                   PAGE=page_size, BLOCK=BLOCK, num_warps=4)
