"""Triton head_token_index: the flat token lists FlashInfer reads, straight from the slot table, in one launch.

One program per (row, head), so shapes alone fix the grid (the op is capturable). A program ranks the head's
slots by the logical page they hold and scatters each slot's page to its ranked place in the list, so the ordered
page list is never gathered (nor staged in memory between two kernels); the sink and window pages come straight
from row_table. Both parts store whole pages as [pages, page_size] tiles. Programs over (row, token block) would
each recompute the ranks (and gather pages by rank), on a latency path no shorter: request slot, its slots, the
ranks, the stores. The stores are what one program adds; at batch 1 each of the H programs stores ~10 KB, a few
vector stores per thread that do not wait for memory. Given q, each program also writes its (row, head)'s G query
rows where the kernel after it reads them: a strided q (SGLang's QKV split) otherwise took a copy launch of its own,
which ran on the branch beside the recall before attention.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._utils import check_device, check_index_vectors
from .naive import check_q_rows

_EMPTY_KEY = 0x7FFFFFFF  # sort key of an empty slot: after every logical page
_SLOTS = 64  # slots ranked at once: a [64, 64] comparison tile
_TILE = 2048  # tokens per [pages, page_size] store tile of sink and window pages


@triton.jit
def _head_token_index_kernel(slots_ptr, req_ptr, row_ptr, nsink_ptr, nslots_ptr, spages_ptr, tokens_ptr, start_ptr,
                             out_ptr, q_ptr, qr_ptr, H, K, st_r, st_h, st_k, sr_b, sr_i, sg_b, sg_k, sq_b, sq_h, sq_d,
                             PAGE: tl.constexpr, SB: tl.constexpr, PB: tl.constexpr, EMPTY_KEY: tl.constexpr,
                             Q: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr):
    pid = tl.program_id(0)
    b = (pid // H).to(tl.int64)
    h = (pid % H).to(tl.int64)
    if Q:  # q[b, h * G + g] -> q_rows[b * H + h, g], contiguous [B * H, G, D]
        g = tl.arange(0, GP)
        d = tl.arange(0, DP)
        m = (g < G)[:, None] & (d < D)[None, :]
        x = tl.load(q_ptr + b * sq_b + (h * G + g)[:, None] * sq_h + d[None, :] * sq_d, mask=m)
        tl.store(qr_ptr + (b * H + h) * G * D + g[:, None] * D + d[None, :], x, mask=m)
    r = tl.load(req_ptr + b).to(tl.int64)
    n = tl.load(tokens_ptr + b)
    first = tl.load(nsink_ptr + b)
    count = tl.load(nslots_ptr + b)
    out = out_ptr + tl.load(start_ptr + b).to(tl.int64) * H + h * n
    j = tl.arange(0, PAGE)
    held_ptr = slots_ptr + r * st_r + h * st_h
    # Selection: slot s's page is list page first + rank(s), ranked by (logical page, slot), empty slots last;
    # slots ranked count or later are not attended. Lanes past K read as empty slots past every slot: they
    # precede none.
    for s0 in range(0, K, SB):
        s = s0 + tl.arange(0, SB)
        held = tl.load(held_ptr + s.to(tl.int64) * st_k, mask=s < K, other=-1)
        page = tl.load(spages_ptr + b * sg_b + s.to(tl.int64) * sg_k, mask=s < K, other=0)
        key = tl.where(held >= 0, held, EMPTY_KEY)
        rank = tl.zeros([SB], dtype=tl.int32)
        for c0 in range(0, K, SB):
            c = c0 + tl.arange(0, SB)
            other = tl.load(held_ptr + c.to(tl.int64) * st_k, mask=c < K, other=-1)
            okey = tl.where(other >= 0, other, EMPTY_KEY)
            before = (okey[None, :] < key[:, None]) | ((okey[None, :] == key[:, None]) & (c[None, :] < s[:, None]))
            rank += tl.sum(before.to(tl.int32), axis=1)
        t = (first + rank)[:, None] * PAGE + j[None, :]
        val = (page.to(tl.int64)[:, None] * PAGE + j[None, :]) * H + h
        tl.store(out + t, val.to(out_ptr.dtype.element_ty), mask=((s < K) & (rank < count))[:, None] & (t < n))
    # Sink and window: list page i is row_table[b, i].
    for i0 in range(0, tl.cdiv(n, PAGE), PB):
        i = i0 + tl.arange(0, PB)
        keep = ((i < first) | (i >= first + count)) & (i * PAGE < n)
        page = tl.load(row_ptr + b * sr_b + i.to(tl.int64) * sr_i, mask=keep, other=0)
        t = i[:, None] * PAGE + j[None, :]
        val = (page.to(tl.int64)[:, None] * PAGE + j[None, :]) * H + h
        tl.store(out + t, val.to(out_ptr.dtype.element_ty), mask=keep[:, None] & (t < n))


def head_token_index(slots: torch.Tensor, req_slots: torch.Tensor, row_table: torch.Tensor, n_sink: torch.Tensor,
                     n_slots: torch.Tensor, slot_pages: torch.Tensor, row_tokens: torch.Tensor, row_start: torch.Tensor,
                     page_size: int, out: torch.Tensor, q: torch.Tensor | None = None,
                     q_rows: torch.Tensor | None = None) -> None:
    """See naive_head_token_index."""
    check_device(slots, req_slots, row_table, n_sink, n_slots, slot_pages, row_tokens, row_start, out)
    check_index_vectors(req_slots=req_slots, n_sink=n_sink, n_slots=n_slots, row_tokens=row_tokens,
                        row_start=row_start, out=out)
    B, _ = row_table.shape
    _, H, K = slots.shape
    assert all(t.shape == (B,) for t in (req_slots, n_sink, n_slots, row_tokens, row_start))
    assert slot_pages.shape == (B, K)
    G, D = check_q_rows(q, q_rows, B, H)
    if q is not None:
        check_device(q, q_rows)
    if B * H == 0:
        return
    sb = min(triton.next_power_of_2(max(K, 1)), _SLOTS)
    _head_token_index_kernel[(B * H,)](slots, req_slots, row_table, n_sink, n_slots, slot_pages, row_tokens,
                                       row_start, out, out if q is None else q, out if q is None else q_rows, H, K,
                                       *slots.stride(), *row_table.stride(), *slot_pages.stride(),
                                       *((0, 0, 0) if q is None else q.stride()), PAGE=page_size, SB=sb,
                                       PB=_TILE // page_size, EMPTY_KEY=_EMPTY_KEY, Q=q is not None, G=G,
                                       GP=triton.next_power_of_2(G), D=D, DP=triton.next_power_of_2(D), num_warps=4)
