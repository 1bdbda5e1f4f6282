"""Page copies between the HND host arena and NHD token rows on the GPU, one zero-copy kernel each way, and from
staging pages into selection slots, GPU to GPU.

On CUDA the arena is pinned (or cudaHostRegister'ed) host memory that the kernels dereference over UVA, like
recall_pages: a page of one KV head is one contiguous host chunk per K and V, read or written in one PCIe transfer,
with no CPU gather, no pageable bounce buffer and no host thread in the loop. Radix prefix sharing moves whole
prompts this way (a hit's prefix into staging, the dense layers' slices to and from the arena). An FP8 arena's rows are
quantised on the way out and widened on the way in, their exponents beside them (freekv_kernels.fp8_rows)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._utils import check_device, check_index_vectors
from ..fp8_rows.naive import check_host_scales
from ..fp8_rows.triton import dequantize_tile, quantize_tile


@triton.jit
def _page_copy_kernel(
    host_ptr, exp_ptr, pages_ptr, k_ptr, v_ptr, rows_ptr,
    H, D,
    s_hp, s_hh, s_hkv, s_ht,
    s_ep, s_eh, s_ekv, s_et,
    s_kt, s_kh, s_vt, s_vh,
    TO_HOST: tl.constexpr, PAGE: tl.constexpr, BLOCK_D: tl.constexpr, SCALED: tl.constexpr,
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
    rows_e = exp_ptr + page * s_ep + h * s_eh + t.to(tl.int64) * s_et
    if TO_HOST:
        kt = tl.load(kp, mask=mask, other=0.0)
        vt = tl.load(vp, mask=mask, other=0.0)
        if SCALED:
            kq, ke = quantize_tile(kt.to(tl.float32))
            vq, ve = quantize_tile(vt.to(tl.float32))
            tl.store(host, kq.to(tl.float8e4nv), mask=mask)
            tl.store(host + s_hkv, vq.to(tl.float8e4nv), mask=mask)
            tl.store(rows_e, ke.to(tl.int8))
            tl.store(rows_e + s_ekv, ve.to(tl.int8))
        else:
            tl.store(host, kt, mask=mask)
            tl.store(host + s_hkv, vt, mask=mask)
    else:
        kt = tl.load(host, mask=mask)
        vt = tl.load(host + s_hkv, mask=mask)
        if SCALED:
            kt = dequantize_tile(kt, tl.load(rows_e))
            vt = dequantize_tile(vt, tl.load(rows_e + s_ekv))
        tl.store(kp, kt.to(k_ptr.dtype.element_ty), mask=mask)
        tl.store(vp, vt.to(v_ptr.dtype.element_ty), mask=mask)


def _copy(host_layer, host_pages, k, v, rows, to_host: bool, host_scales) -> None:
    check_device(host_layer, host_pages, k, v, rows)
    scaled = check_host_scales(host_layer, host_scales)
    if scaled:
        check_device(host_scales)
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
        host_layer, host_scales if scaled else host_pages, host_pages, k, v, rows,
        H, D,
        host_layer.stride(0), host_layer.stride(1), host_layer.stride(2), host_layer.stride(3),
        *(host_scales.stride() if scaled else (0, 0, 0, 0)),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        TO_HOST=to_host, PAGE=p, BLOCK_D=triton.next_power_of_2(D), SCALED=scaled,
        num_warps=4,
    )


def pages_from_host(host_layer: torch.Tensor, host_pages: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    rows: torch.Tensor, host_scales: torch.Tensor | None = None) -> None:
    """See naive_pages_from_host. Asynchronous on the current stream; host_pages and rows on the GPU."""
    _copy(host_layer, host_pages, k, v, rows, False, host_scales)


def pages_to_host(k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor, host_layer: torch.Tensor,
                  host_pages: torch.Tensor, host_scales: torch.Tensor | None = None) -> None:
    """See naive_pages_to_host. Asynchronous on the current stream: synchronise before the host reads the pages."""
    _copy(host_layer, host_pages, k, v, rows, True, host_scales)


@triton.jit(do_not_specialize=["s_stage"])
def _staged_to_slots_kernel(
    sk_ptr, sv_ptr, stage_ptr, slots_ptr, req_ptr, slot_pages_ptr, k_ptr, v_ptr,
    H, D, N,
    s_skt, s_skh, s_svt, s_svh, s_stage, s_sr, s_sh, s_sp,
    s_kt, s_kh, s_vt, s_vh,
    PAGE: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Program (row b * N + slot s, head h): copies the [PAGE, D] tile of K and of V of the slot's logical page from
    its staging page, or nothing for an empty slot."""
    i = tl.program_id(0)
    h = tl.program_id(1)
    b = i // N
    s = i % N
    r = tl.load(req_ptr + b).to(tl.int64)
    j = tl.load(slots_ptr + r * s_sr + h * s_sh + s)
    if j >= 0:
        src = tl.load(stage_ptr + b * s_stage + j).to(tl.int64) * PAGE
        dst = tl.load(slot_pages_ptr + b * s_sp + s).to(tl.int64) * PAGE
        t = tl.arange(0, PAGE).to(tl.int64)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        mask = d < D
        kt = tl.load(sk_ptr + (src + t) * s_skt + h * s_skh + d, mask=mask)
        vt = tl.load(sv_ptr + (src + t) * s_svt + h * s_svh + d, mask=mask)
        tl.store(k_ptr + (dst + t) * s_kt + h * s_kh + d, kt.to(k_ptr.dtype.element_ty), mask=mask)
        tl.store(v_ptr + (dst + t) * s_vt + h * s_vh + d, vt.to(v_ptr.dtype.element_ty), mask=mask)


def staged_to_slots(src_k: torch.Tensor, src_v: torch.Tensor, stage_pages: torch.Tensor, slots: torch.Tensor,
                    req_slots: torch.Tensor, slot_pages: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    page_size: int) -> None:
    """See naive_staged_to_slots. One launch, asynchronous on the current stream."""
    check_device(src_k, src_v, stage_pages, slots, req_slots, slot_pages, k, v)
    check_index_vectors(req_slots=req_slots)
    B, N = slot_pages.shape
    H, D = k.shape[1:]
    p = page_size
    if p & (p - 1):
        raise ValueError(f"page size {p} must be a power of two")
    for name, t in (("src_k", src_k), ("src_v", src_v), ("k", k), ("v", v)):
        if t.dim() != 3 or t.shape[1:] != (H, D) or t.stride(-1) != 1:
            raise ValueError(f"{name} must be [T, {H}, {D}] with a contiguous head dim, got {tuple(t.shape)}")
    if slots.dim() != 3 or slots.shape[1:] != (H, N) or slots.stride(-1) != 1:
        raise ValueError(f"slots must be [R, {H}, {N}] (contiguous slots), got {tuple(slots.shape)}")
    if stage_pages.dim() != 2 or stage_pages.shape[0] != B or req_slots.numel() != B or stage_pages.stride(-1) != 1:
        raise ValueError(f"stage_pages [{B}, W] and req_slots [{B}] must hold one row per slot_pages row, got "
                         f"{tuple(stage_pages.shape)} and {tuple(req_slots.shape)}")
    if slot_pages.stride(-1) != 1:
        raise ValueError("slot_pages must have contiguous columns")
    if B * N == 0:
        return
    _staged_to_slots_kernel[(B * N, H)](
        src_k, src_v, stage_pages, slots, req_slots, slot_pages, k, v,
        H, D, N,
        src_k.stride(0), src_k.stride(1), src_v.stride(0), src_v.stride(1), stage_pages.stride(0),
        slots.stride(0), slots.stride(1), slot_pages.stride(0),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        PAGE=p, BLOCK_D=triton.next_power_of_2(D), num_warps=4,
    )
