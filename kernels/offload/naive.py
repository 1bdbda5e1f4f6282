"""Torch reference for offload_pages: copy whole GPU pages (all heads) into the HND host arena and summarise them."""

from __future__ import annotations

import torch

from freekv_kernels.channel_sketch.naive import naive_write_channel_codes
from freekv_kernels.fp8_rows.naive import check_host_scales, store_host_rows
from freekv_kernels.page_rerank.naive import quantize_keys


def naive_offload_pages(
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
    also codes[dst[i], :, rows] = the rows' 2-bit key codes in that range (freekv_kernels.page_rerank); with
    channels = (channels, lo, inv_step) of a layer's calibration, codes [P, H, p, R / 2] are the rows' 4-bit
    channel codes instead (naive_write_channel_codes). An FP8 host_layer stores the rows quantised, their exponents in
    host_scales [P, H, 2, p] (freekv_kernels.fp8_rows); summaries and codes come from the exact keys.

    A source page that runs past the last row (a prefill tensor whose length is not a multiple of p) copies and
    summarises only the rows that exist; the rest of that host page is left as it was. `programs` shapes the
    Triton launch only.
    """
    p = page_size
    check_host_scales(host_layer, host_scales)
    for s, d, ok in zip(src.tolist(), dst.tolist(), valid.tolist()):
        if ok:
            k = k_cache[s * p : (s + 1) * p]  # [rows, H, D]
            v = v_cache[s * p : (s + 1) * p]
            n = k.shape[0]
            store_host_rows(host_layer, host_scales, (d, slice(None), 0, slice(0, n)), k.transpose(0, 1))
            store_host_rows(host_layer, host_scales, (d, slice(None), 1, slice(0, n)), v.transpose(0, 1))
            summaries[d, :, 0] = k.amin(dim=0)
            summaries[d, :, 1] = k.amax(dim=0)
            if codes is not None and channels is None:
                codes[d, :, : k.shape[0]] = quantize_keys(k.transpose(0, 1), summaries[d, :, 0], summaries[d, :, 1])
    if channels is not None:
        naive_write_channel_codes(k_cache, src, dst, valid, page_size, codes, *channels)
