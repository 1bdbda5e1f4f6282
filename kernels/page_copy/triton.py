"""Page copies between the HND host arena and NHD token rows on the GPU, one zero-copy kernel each way.

On CUDA the arena is pinned (or cudaHostRegister'ed) host memory that the kernels dereference over UVA, like
recall_pages: a page of one KV head is one contiguous host chunk per K and V, read or written in one PCIe transfer,
with no CPU gather, no pageable bounce buffer and no host thread in the loop. Radix prefix sharing moves whole
prompts this way (a hit's prefix into staging, the dense layers' slices to and from the arena)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._utils import check_device, check_index_vectors


@triton.jit
def _page_copy_kernel(
    host_ptr, pages_ptr, k_ptr, v_ptr, rows_ptr,
    H, D,
    s_hp, s_hh, s_hkv, s_ht,
    s_kt, s_kh, s_vt, s_vh,
    TO_HOST: tl.constexpr, PAGE: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Program (page i, head h): the [PAGE, D] tile of K and of V between host page pages[i] and token rows
    rows[i * PAGE ..]. Both loads are issued before either store, so a program keeps the whole chunk in flight."""
    i = tl.program_id(0)
    h = tl.program_id(1)
    t = tl.arange(0, PAGE)
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = d < D
    page = tl.load(pages_ptr + i).to(tl.int64)
    row = tl.load(rows_ptr + i * PAGE + t).to(tl.int64)[:, None]
    host = host_ptr + page * s_hp + h * s_hh + t.to(tl.int64)[:, None] * s_ht + d
    kp = k_ptr + row * s_kt + h * s_kh + d
    vp = v_ptr + row * s_vt + h * s_vh + d
    if TO_HOST:
        kt = tl.load(kp, mask=mask)
        vt = tl.load(vp, mask=mask)
        tl.store(host, kt, mask=mask)
        tl.store(host + s_hkv, vt, mask=mask)
    else:
        kt = tl.load(host, mask=mask)
        vt = tl.load(host + s_hkv, mask=mask)
        tl.store(kp, kt, mask=mask)
        tl.store(vp, vt, mask=mask)


def _copy(host_layer, host_pages, k, v, rows, to_host: bool) -> None:
    check_device(host_layer, host_pages, k, v, rows)
    check_index_vectors(host_pages=host_pages, rows=rows)
    N, H, two, p, D = host_layer.shape
    n = host_pages.numel()
    if two != 2 or k.shape != v.shape or k.dim() != 3 or k.shape[1:] != (H, D):
        raise ValueError(f"host_layer [N, H, 2, p, D] and k / v [T, H, D] disagree: {tuple(host_layer.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if p & (p - 1):
        raise ValueError(f"page size {p} must be a power of two")
    if rows.numel() != n * p:
        raise ValueError(f"{n} pages of {p} tokens need {n * p} rows, got {rows.numel()}")
    if host_layer.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("the head dim must be contiguous in host_layer, k and v")
    if n == 0:
        return
    _page_copy_kernel[(n, H)](
        host_layer, host_pages, k, v, rows,
        H, D,
        host_layer.stride(0), host_layer.stride(1), host_layer.stride(2), host_layer.stride(3),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        TO_HOST=to_host, PAGE=p, BLOCK_D=triton.next_power_of_2(D),
        num_warps=4,
    )


def pages_from_host(host_layer: torch.Tensor, host_pages: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    rows: torch.Tensor) -> None:
    """See naive_pages_from_host. Asynchronous on the current stream; host_pages and rows on the GPU."""
    _copy(host_layer, host_pages, k, v, rows, to_host=False)


def pages_to_host(k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor, host_layer: torch.Tensor,
                  host_pages: torch.Tensor) -> None:
    """See naive_pages_to_host. Asynchronous on the current stream: synchronise before the host reads the pages."""
    _copy(host_layer, host_pages, k, v, rows, to_host=True)
