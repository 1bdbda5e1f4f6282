"""Triton head_pages and head_token_index: each (row, KV head)'s pages in logical order, and the flat token lists
FlashInfer reads, one launch each.

head_pages: one program per (row, head) ranks the head's slots by the logical page they hold.
head_token_index: grid (B * H, cdiv(max tokens, BLOCK)); a program writes BLOCK consecutive tokens of one (row, head)
list. Shapes alone fix both grids (max tokens = resident pages * page size), so the ops can be captured in a CUDA
graph; programs past a row's length exit at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._alloc import empty
from .._utils import check_device, check_index_vectors

BLOCK = 256
_EMPTY_KEY = 0x7FFFFFFF  # sort key of an empty slot: after every logical page


@triton.jit
def _head_pages_kernel(slots_ptr, req_ptr, row_ptr, nsink_ptr, nslots_ptr, spages_ptr, out_ptr, H, K, W,
                       st_r, st_h, st_k, s_req, sr_b, sr_i, s_ns, s_nsl, sg_b, sg_k, so_b, so_h, so_i,
                       KP: tl.constexpr, WP: tl.constexpr, EMPTY_KEY: tl.constexpr):
    pid = tl.program_id(0)
    b = (pid // H).to(tl.int64)
    h = (pid % H).to(tl.int64)
    r = tl.load(req_ptr + b * s_req).to(tl.int64)
    s = tl.arange(0, KP)
    ok = s < K
    held = tl.load(slots_ptr + r * st_r + h * st_h + s.to(tl.int64) * st_k, mask=ok, other=-1)
    key = tl.where(held >= 0, held, EMPTY_KEY)
    # rank[s]: slots before s in (logical page, slot) order; empty slots last.
    before = (key[None, :] < key[:, None]) | ((key[None, :] == key[:, None]) & (s[None, :] < s[:, None]))
    rank = tl.sum((before & ok[None, :]).to(tl.int32), axis=1)
    first = tl.load(nsink_ptr + b * s_ns)
    count = tl.load(nslots_ptr + b * s_nsl)
    i = tl.arange(0, WP)
    out = out_ptr + b * so_b + h * so_h
    row = tl.load(row_ptr + b * sr_b + i.to(tl.int64) * sr_i, mask=i < W, other=0)
    tl.store(out + i.to(tl.int64) * so_i, row, mask=(i < W) & ((i < first) | (i >= first + count)))
    pages = tl.load(spages_ptr + b * sg_b + s.to(tl.int64) * sg_k, mask=ok, other=0)
    tl.store(out + (first + rank).to(tl.int64) * so_i, pages, mask=ok & (rank < count))


def head_pages(slots: torch.Tensor, req_slots: torch.Tensor, row_table: torch.Tensor, n_sink: torch.Tensor,
               n_slots: torch.Tensor, slot_pages: torch.Tensor) -> torch.Tensor:
    check_device(slots, req_slots, row_table, n_sink, n_slots, slot_pages)
    check_index_vectors(req_slots=req_slots, n_sink=n_sink, n_slots=n_slots)
    B, W = row_table.shape
    _, H, K = slots.shape
    assert req_slots.shape == (B,) and n_sink.shape == (B,) and n_slots.shape == (B,) and slot_pages.shape == (B, K)
    out = empty(B, H, W, dtype=torch.int32, device=row_table.device)
    if B * H == 0:
        return out
    _head_pages_kernel[(B * H,)](slots, req_slots, row_table, n_sink, n_slots, slot_pages, out, H, K, W,
                                *slots.stride(), req_slots.stride(0), *row_table.stride(), n_sink.stride(0),
                                n_slots.stride(0), *slot_pages.stride(), *out.stride(),
                                KP=triton.next_power_of_2(K), WP=triton.next_power_of_2(W), EMPTY_KEY=_EMPTY_KEY,
                                num_warps=4)
    return out


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
