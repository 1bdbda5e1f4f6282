"""Offload: write whole GPU pages (every head) into the HND host arena, NHD -> HND fused into the copy, and
summarise them (per-head elementwise min / max of the keys) from the same read, with the selection's key codes
(the rerank's 2-bit codes or the channel sketch's 4-bit codes) in the same launch.

On CUDA `host_layer` is pinned (or cudaHostRegister'ed) host memory that the kernel writes directly over UVA. An FP8
arena's rows are quantised in the same pass (freekv_kernels.fp8_rows), their exponents written beside them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._utils import capped_grid, check_device, check_index_vectors
from ..channel_sketch.naive import BITS as CHANNEL_BITS
from ..channel_sketch.naive import LEVELS as CHANNEL_LEVELS
from ..fp8_rows.naive import check_host_scales
from ..fp8_rows.triton import quantize_tile
from ..page_rerank.naive import CODE_BITS, LEVELS, PER_BYTE


@triton.jit(do_not_specialize=["T", "N"])
def _offload_pages_kernel(
    k_ptr,
    v_ptr,
    host_ptr,
    exp_ptr,
    summ_ptr,
    codes_ptr,
    ch_ptr,
    lo_ptr,
    inv_ptr,
    src_ptr,
    dst_ptr,
    valid_ptr,
    T,
    N,
    s_kt,
    s_kh,
    s_vt,
    s_vh,
    s_hp,
    s_hh,
    s_hkv,
    s_ht,
    s_ep,
    s_eh,
    s_ekv,
    s_et,
    s_sp,
    s_sh,
    s_smm,
    s_cp,
    s_ch,
    s_ct,
    s_cj,
    s_chh,
    H: tl.constexpr,
    PAGE: tl.constexpr,
    D: tl.constexpr,
    CODES: tl.constexpr,
    LEVELS: tl.constexpr,
    BITS: tl.constexpr,
    PER_BYTE: tl.constexpr,
    CHANNELS: tl.constexpr,
    HALF: tl.constexpr,
    CH_LEVELS: tl.constexpr,
    CH_BITS: tl.constexpr,
    SCALED: tl.constexpr,
):
    """Work item w = (entry w // H, head w % H); programs stride over the N * H items. CODES: 2-bit codes of every
    channel in the page's range; CHANNELS: 4-bit codes of the 2 * HALF calibrated channels (ch / lo / inv_step rows
    of s_chh per head), two per byte."""
    t = tl.arange(0, PAGE).to(tl.int64)[:, None]
    d = tl.arange(0, D)[None, :]
    for w in range(tl.program_id(0), N * H, tl.num_programs(0)):
        i = w // H
        h = w % H  # h * (any head stride) stays far below 2**31
        # Invalid entries may carry garbage indices: every access through them is masked off.
        ok = tl.load(valid_ptr + i) != 0
        row0 = tl.load(src_ptr + i).to(tl.int64) * PAGE
        rows = row0 + t
        # A prefill tensor's last page may be partial: rows past T are neither read nor written.
        m = (rows < T) & ok
        k = tl.load(k_ptr + rows * s_kt + h * s_kh + d, mask=m)
        v = tl.load(v_ptr + rows * s_vt + h * s_vh + d, mask=m)
        dst = tl.load(dst_ptr + i).to(tl.int64)
        chunk = host_ptr + dst * s_hp + h * s_hh + t * s_ht + d
        kf = k.to(tl.float32)
        if SCALED:
            rows_e = exp_ptr + dst * s_ep + h * s_eh + tl.arange(0, PAGE).to(tl.int64) * s_et
            m_row = (row0 + tl.arange(0, PAGE) < T) & ok  # m, one flag per row
            kq, ke = quantize_tile(kf)
            vq, ve = quantize_tile(v.to(tl.float32))
            tl.store(chunk, kq.to(tl.float8e4nv), mask=m)
            tl.store(chunk + s_hkv, vq.to(tl.float8e4nv), mask=m)
            tl.store(rows_e, ke.to(tl.int8), mask=m_row)
            tl.store(rows_e + s_ekv, ve.to(tl.int8), mask=m_row)
        else:
            tl.store(chunk, k, mask=m)
            tl.store(chunk + s_hkv, v, mask=m)
        # min / max in fp32 are exact for every cache dtype, and so is the cast back.
        summ = summ_ptr + dst * s_sp + h * s_sh + tl.arange(0, D)
        kmin = tl.min(tl.where(m, kf, float("inf")), axis=0)
        kmax = tl.max(tl.where(m, kf, float("-inf")), axis=0)
        tl.store(summ, kmin.to(summ_ptr.dtype.element_ty), mask=ok)
        tl.store(summ + s_smm, kmax.to(summ_ptr.dtype.element_ty), mask=ok)
        if CODES:
            # Bins by exact comparisons (no division: every device rounds alike), 4 channels per byte.
            lo = kmin[None, :]
            span = kmax[None, :] - lo
            x = 4.0 * (kf - lo)
            code = (x >= span).to(tl.int32) + (x >= 2.0 * span).to(tl.int32) + (x >= 3.0 * span).to(tl.int32)
            code = tl.where(span > 0, code, 0)
            shifts = (tl.arange(0, PER_BYTE) * BITS)[None, None, :]
            packed = tl.sum(tl.reshape(code, [PAGE, D // PER_BYTE, PER_BYTE]) << shifts, axis=2)
            j = tl.arange(0, D // PER_BYTE)[None, :]
            tl.store(codes_ptr + dst * s_cp + h * s_ch + t * s_ct + j * s_cj, packed.to(tl.uint8), mask=m)
        if CHANNELS:
            # The calibrated channels' keys, gathered again from the rows just read (cached); fixed bins per channel.
            j = tl.arange(0, HALF)
            out = tl.zeros([PAGE, HALF], tl.int32)
            for part in tl.static_range(2):
                ch = tl.load(ch_ptr + h * s_chh + part * HALF + j).to(tl.int64)
                lo = tl.load(lo_ptr + h * s_chh + part * HALF + j)
                inv = tl.load(inv_ptr + h * s_chh + part * HALF + j)
                kc = tl.load(k_ptr + rows * s_kt + h * s_kh + ch[None, :], mask=m, other=0.0).to(tl.float32)
                c = tl.minimum(tl.maximum(tl.floor((kc - lo[None, :]) * inv[None, :]), 0.0), CH_LEVELS - 1)
                out = out | (c.to(tl.int32) << (CH_BITS * part))
            tl.store(codes_ptr + dst * s_cp + h * s_ch + t * s_ct + j[None, :] * s_cj, out.to(tl.uint8), mask=m)


def offload_pages(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    host_layer: torch.Tensor,
    summaries: torch.Tensor,
    src: torch.Tensor,
    dst: torch.Tensor,
    valid: torch.Tensor,
    page_size: int,
    programs: int = 0,
    codes: torch.Tensor | None = None,
    channels: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    host_scales: torch.Tensor | None = None,
) -> None:
    """For each valid i: host_layer[dst[i], :, 0 / 1] <- rows src[i]*p .. +p of k_cache / v_cache, NHD -> HND, and
    summaries[dst[i], :, 0 / 1] = the elementwise min / max over those rows of k_cache; with codes [P, H, p, D / 4],
    also the rows' 2-bit key codes in that range (freekv_kernels.page_rerank), from the same read; with channels
    (a layer's calibrated channels [H, R], lo [H, R] and inv_step [H, R]), codes [P, H, p, R / 2] are the rows'
    4-bit channel codes instead (freekv_kernels.channel_sketch). An FP8 host_layer stores each row quantised, its
    exponent in host_scales [P, H, 2, p] (freekv_kernels.fp8_rows); summaries and codes come from the exact keys.

    A source page that runs past the last row (a prefill tensor whose length is not a multiple of p) copies and
    summarises only the rows that exist; the rest of that host page is left as it was.

    programs > 0 caps the programs launched (each strides over the (page, head) items): a prefill offload running
    beside the model's GEMMs then holds a few SMs instead of one CTA per item (benchmarks/prefill_offload.py).
    """
    check_device(k_cache, v_cache, host_layer, summaries, src, dst, valid)
    check_index_vectors(src=src, dst=dst, valid=valid)
    n = src.shape[0]
    T, H, D = k_cache.shape
    assert v_cache.shape == k_cache.shape and host_layer.shape[1:] == (H, 2, page_size, D)
    assert summaries.shape[1:] == (H, 2, D) and summaries.stride(-1) == 1
    assert host_layer.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    if check_host_scales(host_layer, host_scales):
        check_device(host_scales)
    scaled = host_scales is not None
    half = 0
    if channels is not None:
        assert codes is not None, "channel codes need their store (codes)"
        check_device(codes, *channels)
        ch, lo, inv = channels
        half = ch.shape[1] // 2
        assert codes.shape[1:] == (H, page_size, half) and codes.dtype == torch.uint8 and codes.stride(3) == 1
        assert ch.dtype == torch.int32 and lo.dtype == inv.dtype == torch.float32 and half & (half - 1) == 0
        assert all(t.shape == (H, 2 * half) and t.stride() == ch.stride() and t.stride(1) == 1 for t in (lo, inv))
    elif codes is not None:
        check_device(codes)
        assert codes.shape[1:] == (H, page_size, D // PER_BYTE) and codes.dtype == torch.uint8
    if n == 0:
        return
    ch, lo, inv = channels if channels is not None else (summaries,) * 3
    _offload_pages_kernel[capped_grid(n * H, programs)](
        k_cache,
        v_cache,
        host_layer,
        host_scales if scaled else src,
        summaries,
        summaries if codes is None else codes,
        ch,
        lo,
        inv,
        src,
        dst,
        valid,
        T,
        n,
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        host_layer.stride(0),
        host_layer.stride(1),
        host_layer.stride(2),
        host_layer.stride(3),
        *(host_scales.stride() if scaled else (0, 0, 0, 0)),
        summaries.stride(0),
        summaries.stride(1),
        summaries.stride(2),
        *((0, 0, 0, 0) if codes is None else codes.stride()),
        ch.stride(0) if channels is not None else 0,
        H=H,
        PAGE=page_size,
        D=D,
        CODES=codes is not None and channels is None,
        LEVELS=LEVELS,
        BITS=CODE_BITS,
        PER_BYTE=PER_BYTE,
        CHANNELS=channels is not None,
        HALF=max(half, 1),
        CH_LEVELS=CHANNEL_LEVELS,
        CH_BITS=CHANNEL_BITS,
        SCALED=scaled,
        num_warps=4,
    )
