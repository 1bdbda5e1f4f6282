"""Triton plan_step: every index tensor of a decode step in one launch.

Grid cdiv(B, ROWS): a program plans ROWS consecutive rows (one program up to 16 rows). row_start, the exclusive prefix
sum of row_tokens, needs no second launch: a program recomputes the row_tokens of the rows before its own from their
lengths, BLOCK_B rows per iteration (no iteration in the first program, one up to BLOCK_B earlier rows), and scans its
own. The dense outputs ([B, M] and two vectors) are compiled out unless given.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._utils import check_device, check_index_vectors

ROWS = 16  # rows per program
BLOCK_B = 256  # earlier rows per iteration of the prefix sum
BLOCK_M = 128  # dense-table columns per iteration


@triton.jit
def _row_geometry(n, P: tl.constexpr, NS: tl.constexpr, K: tl.constexpr, NW: tl.constexpr, RETRIEVAL: tl.constexpr):
    """(n_sink, n_slots, window start, row pages, row tokens) of rows with n >= 1 tokens."""
    c = (n - 1) // P
    n_sink = tl.minimum(c + 1, NS)
    if RETRIEVAL:
        n_slots = tl.minimum(tl.maximum(c - NW - NS, 0), K)
    else:
        n_slots = tl.zeros_like(c)
    win_start = tl.maximum(c - NW, NS)
    row_pages = n_sink + n_slots + tl.maximum(c + 1 - win_start, 0)
    return n_sink, n_slots, win_start, row_pages, (row_pages - 1) * P + (n - 1) % P + 1


@triton.jit(do_not_specialize=["B"])
def _plan_step_kernel(req_ptr, lens_ptr, pt_ptr, sparse_loc_ptr, row_ptr, row_pages_ptr, row_tokens_ptr,
                      row_start_ptr, n_sink_ptr, n_slots_ptr, lpl_ptr, cand_end_ptr, slot_pages_ptr, off_src_ptr,
                      off_dst_ptr, off_valid_ptr, dense_loc_ptr, dense_ptr, dense_pages_ptr, B, M, pad_slot,
                      s_pt_r, s_pt_m, s_row_b, s_row_i, s_sp_b, s_sp_k, s_d_b, s_d_j,
                      P: tl.constexpr, NS: tl.constexpr, K: tl.constexpr, NW: tl.constexpr, RETRIEVAL: tl.constexpr,
                      DENSE: tl.constexpr, ROWS: tl.constexpr, WP: tl.constexpr, KP: tl.constexpr,
                      BLOCK_B: tl.constexpr, BLOCK_M: tl.constexpr):
    W: tl.constexpr = NS + K + NW + 1
    first = tl.program_id(0) * ROWS
    b = first + tl.arange(0, ROWS)
    live = b < B
    b64 = b.to(tl.int64)
    r = tl.load(req_ptr + b64, mask=live, other=0)
    n = tl.load(lens_ptr + b64, mask=live, other=1)
    r64 = r.to(tl.int64)
    c = (n - 1) // P
    off = (n - 1) % P
    base = 1 + r64 * W
    ring0 = base + NS + K
    n_sink, n_slots, win_start, row_pages, row_tokens = _row_geometry(n, P, NS, K, NW, RETRIEVAL)

    # row_start: the tokens of the rows before this program's, recomputed from their lengths, then a scan.
    acc = tl.zeros([BLOCK_B], dtype=tl.int32)
    for s in range(0, first, BLOCK_B):
        e = s + tl.arange(0, BLOCK_B)
        m = e < first
        _, _, _, _, earlier = _row_geometry(tl.load(lens_ptr + e.to(tl.int64), mask=m, other=1), P, NS, K, NW,
                                            RETRIEVAL)
        acc += tl.where(m, earlier, 0)
    tokens = tl.where(live, row_tokens, 0)
    row_start = tl.sum(acc, axis=0) + tl.cumsum(tokens, axis=0) - tokens

    sparse_page = tl.where(c < NS, base + c, ring0 + (c - NS) % (NW + 1))
    tl.store(sparse_loc_ptr + b64, sparse_page * P + off, mask=live)
    tl.store(row_pages_ptr + b64, row_pages, mask=live)
    tl.store(row_tokens_ptr + b64, row_tokens, mask=live)
    tl.store(row_start_ptr + b64, row_start, mask=live)
    tl.store(n_sink_ptr + b64, n_sink, mask=live)
    tl.store(n_slots_ptr + b64, n_slots, mask=live)
    tl.store(lpl_ptr + b64, off + 1, mask=live)
    if RETRIEVAL:
        tl.store(cand_end_ptr + b64, c - NW, mask=live)
    else:
        tl.store(cand_end_ptr + b64, tl.zeros_like(c) + NS, mask=live)

    # Row table: sink pages, selection slots, then the window from win_start on; zeros past row_pages.
    i = tl.arange(0, WP)[None, :]
    in_slots = i - n_sink[:, None]
    in_win = in_slots - n_slots[:, None]
    row = tl.where(i < n_sink[:, None], base[:, None] + i,
                   tl.where(in_win < 0, base[:, None] + NS + in_slots,
                            ring0[:, None] + (win_start[:, None] + in_win - NS) % (NW + 1)))
    row = tl.where(i < row_pages[:, None], row, 0)
    tl.store(row_ptr + b64[:, None] * s_row_b + i.to(tl.int64) * s_row_i, row.to(tl.int32),
             mask=live[:, None] & (i < W))
    k = tl.arange(0, KP)[None, :]
    tl.store(slot_pages_ptr + b64[:, None] * s_sp_b + k.to(tl.int64) * s_sp_k, (base[:, None] + NS + k).to(tl.int32),
             mask=live[:, None] & (k < K))

    # The page leaving the window after this step, once it is past the sink (never for padding rows).
    leaving = n // P - NW - 1
    valid = (n % P == 0) & (leaving >= NS) & (r != pad_slot) & live
    leaving_c = tl.minimum(tl.maximum(leaving, 0), M - 1).to(tl.int64)
    dst = tl.load(pt_ptr + r64 * s_pt_r + leaving_c * s_pt_m, mask=valid, other=0)
    tl.store(off_src_ptr + b64, tl.where(valid, ring0 + (leaving - NS) % (NW + 1), 0).to(tl.int32), mask=live)
    tl.store(off_dst_ptr + b64, dst, mask=live)
    tl.store(off_valid_ptr + b64, valid, mask=live)

    if DENSE:
        dense_first = 1 + r64 * M
        tl.store(dense_loc_ptr + b64, (dense_first + c) * P + off, mask=live)
        tl.store(dense_pages_ptr + b64, c + 1, mask=live)
        for j0 in range(0, M, BLOCK_M):
            j = j0 + tl.arange(0, BLOCK_M)[None, :]
            tl.store(dense_ptr + b64[:, None] * s_d_b + j.to(tl.int64) * s_d_j,
                     tl.where(j <= c[:, None], dense_first[:, None] + j, 0).to(tl.int32), mask=live[:, None] & (j < M))


def plan_step(req_slots: torch.Tensor, seq_lens: torch.Tensor, page_table: torch.Tensor, page_size: int,
              sink_pages: int, window_pages: int, pad_slot: int, retrieval: bool, *,
              sparse_loc: torch.Tensor, row_table: torch.Tensor, row_pages: torch.Tensor,
              row_tokens: torch.Tensor, row_start: torch.Tensor, n_sink: torch.Tensor, n_slots: torch.Tensor,
              last_page_len: torch.Tensor, cand_end: torch.Tensor, slot_pages: torch.Tensor,
              offload_src: torch.Tensor, offload_dst: torch.Tensor, offload_valid: torch.Tensor,
              dense_loc: torch.Tensor | None = None, dense_table: torch.Tensor | None = None,
              dense_pages: torch.Tensor | None = None) -> None:
    vectors = dict(req_slots=req_slots, seq_lens=seq_lens, sparse_loc=sparse_loc, row_pages=row_pages,
                   row_tokens=row_tokens, row_start=row_start, n_sink=n_sink, n_slots=n_slots,
                   last_page_len=last_page_len, cand_end=cand_end, offload_src=offload_src, offload_dst=offload_dst,
                   offload_valid=offload_valid)
    dense = dense_table is not None
    assert (dense_loc is not None) == dense == (dense_pages is not None), "dense outputs come together"
    if dense:
        vectors.update(dense_loc=dense_loc, dense_pages=dense_pages)
    check_device(page_table, row_table, slot_pages, *vectors.values(), *([dense_table] if dense else []))
    check_index_vectors(**vectors)
    B, W = row_table.shape
    K, M = slot_pages.shape[1], page_table.shape[1]
    assert W == sink_pages + K + window_pages + 1 and slot_pages.shape[0] == B
    assert all(v.shape == (B,) for v in vectors.values())
    assert not dense or dense_table.shape == (B, M)
    if B == 0:
        return
    rows = min(triton.next_power_of_2(B), ROWS)
    # Without the dense outputs their pointers are placeholders the kernel compiles out.
    dense_args = (dense_loc, dense_table, dense_pages) if dense else (sparse_loc, row_table, row_pages)
    _plan_step_kernel[(triton.cdiv(B, rows),)](
        req_slots, seq_lens, page_table, sparse_loc, row_table, row_pages, row_tokens, row_start, n_sink, n_slots,
        last_page_len, cand_end, slot_pages, offload_src, offload_dst, offload_valid, *dense_args, B, M, pad_slot,
        *page_table.stride(), *row_table.stride(), *slot_pages.stride(), *(dense_table.stride() if dense else (0, 0)),
        P=page_size, NS=sink_pages, K=K, NW=window_pages, RETRIEVAL=retrieval, DENSE=dense, ROWS=rows,
        WP=triton.next_power_of_2(W), KP=triton.next_power_of_2(K), BLOCK_B=BLOCK_B,
        BLOCK_M=min(triton.next_power_of_2(M), BLOCK_M), num_warps=4)
