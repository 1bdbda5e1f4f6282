"""Recall: gather (page, head) chunks from the host arena into GPU pages, HND -> NHD, in one zero-copy kernel.

On CUDA `host_layer` is pinned (or cudaHostRegister'ed) host memory; the kernel dereferences it over UVA, so the
gather and the layout transpose cost one PCIe read of each chunk and no staging buffer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._utils import check_device, check_index_vectors


@triton.jit
def _recall_pages_kernel(
    host_ptr,
    k_ptr,
    v_ptr,
    src_ptr,
    head_ptr,
    dst_ptr,
    valid_ptr,
    s_hp,
    s_hh,
    s_hkv,
    s_ht,
    s_kt,
    s_kh,
    s_vt,
    s_vh,
    PAGE: tl.constexpr,
    D: tl.constexpr,
):
    i = tl.program_id(0)
    # Invalid entries may carry garbage indices: decide before reading any of them.
    if not tl.load(valid_ptr + i):
        return
    src = tl.load(src_ptr + i).to(tl.int64)
    h = tl.load(head_ptr + i).to(tl.int64)
    row0 = tl.load(dst_ptr + i).to(tl.int64) * PAGE
    t = tl.arange(0, PAGE).to(tl.int64)[:, None]
    d = tl.arange(0, D)[None, :]
    # One [PAGE, D] tile per K and V: both loads are issued before either store, so each program keeps the whole
    # 2*PAGE*D chunk in flight over PCIe (wide vector loads, several per thread).
    chunk = host_ptr + src * s_hp + h * s_hh + t * s_ht + d
    k = tl.load(chunk)
    v = tl.load(chunk + s_hkv)
    tl.store(k_ptr + (row0 + t) * s_kt + h * s_kh + d, k)
    tl.store(v_ptr + (row0 + t) * s_vt + h * s_vh + d, v)


def recall_pages(
    host_layer: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    src: torch.Tensor,
    head: torch.Tensor,
    dst: torch.Tensor,
    valid: torch.Tensor,
    page_size: int,
) -> None:
    """For each valid i: rows dst[i]*p .. +p, head head[i] of k_cache / v_cache <- host_layer[src[i], head[i], 0/1]."""
    check_device(host_layer, k_cache, v_cache, src, head, dst, valid)
    check_index_vectors(src=src, head=head, dst=dst, valid=valid)
    n = src.shape[0]
    D = host_layer.shape[-1]
    assert v_cache.shape == k_cache.shape and k_cache.shape[1:] == (host_layer.shape[1], D)
    assert host_layer.shape[2:] == (2, page_size, D)
    assert host_layer.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    if n == 0:
        return
    _recall_pages_kernel[(n,)](
        host_layer,
        k_cache,
        v_cache,
        src,
        head,
        dst,
        valid,
        host_layer.stride(0),
        host_layer.stride(1),
        host_layer.stride(2),
        host_layer.stride(3),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        PAGE=page_size,
        D=D,
        num_warps=4,
    )
