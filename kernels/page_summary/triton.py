"""Page summaries: the elementwise min / max of each (page, head)'s keys, read from the NHD GPU cache."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._utils import check_device, check_index_vectors


@triton.jit
def _page_summary_kernel(
    k_ptr,
    pages_ptr,
    dst_ptr,
    valid_ptr,
    sum_ptr,
    s_kt,
    s_kh,
    s_sp,
    s_sh,
    s_smm,
    PAGE: tl.constexpr,
    D: tl.constexpr,
):
    i = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    # Invalid entries may carry garbage indices: decide before reading any of them.
    if not tl.load(valid_ptr + i):
        return
    row0 = tl.load(pages_ptr + i).to(tl.int64) * PAGE
    t = tl.arange(0, PAGE).to(tl.int64)[:, None]
    d = tl.arange(0, D)
    keys = tl.load(k_ptr + (row0 + t) * s_kt + h * s_kh + d[None, :])
    out = sum_ptr + tl.load(dst_ptr + i).to(tl.int64) * s_sp + h * s_sh + d
    tl.store(out, tl.min(keys, axis=0))
    tl.store(out + s_smm, tl.max(keys, axis=0))


def page_summary(
    k_cache: torch.Tensor,
    pages: torch.Tensor,
    dst: torch.Tensor,
    valid: torch.Tensor,
    summaries: torch.Tensor,
    page_size: int,
) -> None:
    """For each valid i: summaries[dst[i], :, 0 / 1] = min / max over the keys of GPU page pages[i]."""
    check_device(k_cache, pages, dst, valid, summaries)
    check_index_vectors(pages=pages, dst=dst, valid=valid)
    n = pages.shape[0]
    _, H, D = k_cache.shape
    assert summaries.shape[1:] == (H, 2, D)
    assert k_cache.stride(-1) == 1 and summaries.stride(-1) == 1
    if n == 0:
        return
    _page_summary_kernel[(n, H)](
        k_cache,
        pages,
        dst,
        valid,
        summaries,
        k_cache.stride(0),
        k_cache.stride(1),
        summaries.stride(0),
        summaries.stride(1),
        summaries.stride(2),
        PAGE=page_size,
        D=D,
        num_warps=4,
    )
