"""Triton segment_pages: one program per (row, KV head) on the recall stream, beside the offload of the same page."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._utils import check_device, check_index_vectors


@triton.jit
def _segment_pages_kernel(
    k_ptr, lens_ptr, slots_ptr, src_ptr, dst_ptr, valid_ptr, marks_ptr, sum_ptr, len_ptr, row_ptr, ord_ptr,
    cent_ptr, count_ptr, range_ptr,
    sink_pages, window_pages, max_tokens,
    sk_t, sk_h, sk_d,
    sm_r, sm_m,
    ss_r, ss_h, ss_d,
    sl_r, sl_h,
    sc_u, sc_h, sc_d,
    sn_u, sn_h,
    sr_p, sr_h, sr_i,
    P: tl.constexpr, D: tl.constexpr, UPP: tl.constexpr, UPP_P: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    if tl.load(valid_ptr + b).to(tl.int32) == 0:
        return
    r = tl.load(slots_ptr + b).to(tl.int64)
    hp = tl.load(dst_ptr + b).to(tl.int64)
    src = tl.load(src_ptr + b).to(tl.int64)
    j = tl.load(lens_ptr + b) // P - window_pages - 1
    t = tl.arange(0, P)
    d = tl.arange(0, D)
    keys = tl.load(k_ptr + (src * P + t).to(tl.int64)[:, None] * sk_t + h * sk_h + d[None, :] * sk_d)
    page_sum = tl.sum(keys.to(tl.float32), axis=0)
    st = r * sl_r + h * sl_h
    open_row = tl.load(row_ptr + st)
    n_open = tl.load(len_ptr + st)
    new = (tl.load(marks_ptr + r * sm_r + j.to(tl.int64) * sm_m) != 0) | (open_row < 0) | (n_open + P > max_tokens)
    sum_ptrs = sum_ptr + r * ss_r + h * ss_h + d * ss_d
    if new:
        row = hp * UPP
        ordinal = (j - sink_pages) * UPP
        total = page_sum
        n = n_open * 0 + P
    else:
        row = open_row.to(tl.int64)
        ordinal = tl.load(ord_ptr + st)
        total = tl.load(sum_ptrs) + page_sum
        n = n_open + P
    i = tl.arange(0, UPP_P)
    tl.store(count_ptr + (hp * UPP + i) * sn_u + h * sn_h, tl.zeros([UPP_P], tl.int32), mask=i < UPP)
    tl.debug_barrier()  # the count of a new segment's row, below, lands after the clearing above
    tl.store(cent_ptr + row * sc_u + h * sc_h + d * sc_d, (total / n).to(cent_ptr.dtype.element_ty))
    tl.store(count_ptr + row * sn_u + h * sn_h, n)
    tl.store(range_ptr + hp * sr_p + h * sr_h, ordinal)
    tl.store(range_ptr + hp * sr_p + h * sr_h + sr_i, ordinal)
    tl.store(sum_ptrs, total)
    tl.store(len_ptr + st, n)
    tl.store(row_ptr + st, row.to(tl.int32))
    tl.store(ord_ptr + st, ordinal)


def segment_pages(
    k_cache: torch.Tensor,
    lens: torch.Tensor,
    req_slots: torch.Tensor,
    offload_src: torch.Tensor,
    offload_dst: torch.Tensor,
    offload_valid: torch.Tensor,
    marks: torch.Tensor,
    seg_sum: torch.Tensor,
    seg_len: torch.Tensor,
    seg_row: torch.Tensor,
    seg_ord: torch.Tensor,
    centroids: torch.Tensor,
    counts: torch.Tensor,
    ranges: torch.Tensor,
    page_size: int,
    sink_pages: int,
    window_pages: int,
    max_tokens: int,
) -> None:
    check_device(k_cache, lens, req_slots, offload_src, offload_dst, offload_valid, marks, seg_sum, seg_len, seg_row,
                 seg_ord, centroids, counts, ranges)
    check_index_vectors(lens=lens, req_slots=req_slots, offload_src=offload_src, offload_dst=offload_dst,
                        offload_valid=offload_valid)
    B = req_slots.shape[0]
    _, H, D = k_cache.shape
    P = ranges.shape[0]
    upp = centroids.shape[0] // P
    assert centroids.shape == (P * upp, H, D) and counts.shape == (P * upp, H) and ranges.shape == (P, H, 2)
    assert seg_sum.dtype == torch.float32 and seg_sum.shape[1:] == (H, D) and seg_len.stride() == seg_row.stride() \
        == seg_ord.stride()
    if B == 0:
        return
    _segment_pages_kernel[(B, H)](
        k_cache, lens, req_slots, offload_src, offload_dst, offload_valid, marks, seg_sum, seg_len, seg_row, seg_ord,
        centroids, counts, ranges, sink_pages, window_pages, max_tokens,
        *k_cache.stride(), *marks.stride(), *seg_sum.stride(), *seg_len.stride(), *centroids.stride(),
        *counts.stride(), *ranges.stride(),
        P=page_size, D=D, UPP=upp, UPP_P=triton.next_power_of_2(upp),
    )
