"""Offload: write whole GPU pages (every head) into the HND host arena, NHD -> HND fused into the copy.

On CUDA `host_layer` is pinned (or cudaHostRegister'ed) host memory that the kernel writes directly over UVA.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._utils import check_device, check_index_vectors


@triton.jit
def _offload_pages_kernel(
    k_ptr,
    v_ptr,
    host_ptr,
    src_ptr,
    dst_ptr,
    valid_ptr,
    T,
    s_kt,
    s_kh,
    s_vt,
    s_vh,
    s_hp,
    s_hh,
    s_hkv,
    s_ht,
    PAGE: tl.constexpr,
    D: tl.constexpr,
):
    i = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    # Invalid entries may carry garbage indices: decide before reading any of them.
    if not tl.load(valid_ptr + i):
        return
    rows = tl.load(src_ptr + i).to(tl.int64) * PAGE + tl.arange(0, PAGE).to(tl.int64)
    # A prefill tensor's last page may be partial: rows past T are neither read nor written.
    m = (rows < T)[:, None]
    t = tl.arange(0, PAGE).to(tl.int64)[:, None]
    d = tl.arange(0, D)[None, :]
    k = tl.load(k_ptr + rows[:, None] * s_kt + h * s_kh + d, mask=m)
    v = tl.load(v_ptr + rows[:, None] * s_vt + h * s_vh + d, mask=m)
    chunk = host_ptr + tl.load(dst_ptr + i).to(tl.int64) * s_hp + h * s_hh + t * s_ht + d
    tl.store(chunk, k, mask=m)
    tl.store(chunk + s_hkv, v, mask=m)


def offload_pages(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    host_layer: torch.Tensor,
    src: torch.Tensor,
    dst: torch.Tensor,
    valid: torch.Tensor,
    page_size: int,
) -> None:
    """For each valid i: host_layer[dst[i], :, 0 / 1] <- rows src[i]*p .. +p of k_cache / v_cache, NHD -> HND.

    A source page that runs past the last row (a prefill tensor whose length is not a multiple of p) copies only
    the rows that exist; the rest of that host page is left as it was.
    """
    check_device(k_cache, v_cache, host_layer, src, dst, valid)
    check_index_vectors(src=src, dst=dst, valid=valid)
    n = src.shape[0]
    T, H, D = k_cache.shape
    assert v_cache.shape == k_cache.shape and host_layer.shape[1:] == (H, 2, page_size, D)
    assert host_layer.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    if n == 0:
        return
    _offload_pages_kernel[(n, H)](
        k_cache,
        v_cache,
        host_layer,
        src,
        dst,
        valid,
        T,
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        host_layer.stride(0),
        host_layer.stride(1),
        host_layer.stride(2),
        host_layer.stride(3),
        PAGE=page_size,
        D=D,
        num_warps=4,
    )
