"""Torch references for the page copies between the HND host arena and NHD token rows on the GPU (SGLang's pool
buffers, staging pages, the engine's pages): whole pages of every KV head, K and V."""

from __future__ import annotations

import torch

from ..fp8_rows.naive import check_host_scales, host_rows, store_host_rows


def naive_pages_from_host(host_layer: torch.Tensor, host_pages: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          rows: torch.Tensor, host_scales: torch.Tensor | None = None) -> None:
    """k[rows[i * p + t], h] = host_layer[host_pages[i], h, 0, t] and v likewise from [..., 1, ...], for every page i,
    head h and token t; host_layer [N, H, 2, p, D], k / v [T, H, D], rows [n * p]. An FP8 host_layer's rows are
    widened with their exponents host_scales [N, H, 2, p] (freekv_kernels.fp8_rows)."""
    check_host_scales(host_layer, host_scales)
    chunk = host_rows(host_layer, host_scales, host_pages.long().cpu(), k.dtype).to(k.device)  # [n, H, 2, p, D]
    idx = rows.long().to(k.device)
    for i, out in enumerate((k, v)):
        out[idx] = chunk[:, :, i].transpose(1, 2).reshape(-1, *out.shape[1:]).to(out.dtype)


def naive_pages_to_host(k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor, host_layer: torch.Tensor,
                        host_pages: torch.Tensor, host_scales: torch.Tensor | None = None) -> None:
    """host_layer[host_pages[i], h, 0, t] = k[rows[i * p + t], h] and [..., 1, ...] from v: the inverse copy
    (quantised, with the exponents into host_scales, for an FP8 host_layer)."""
    check_host_scales(host_layer, host_scales)
    p, H, D = host_layer.shape[3], host_layer.shape[1], host_layer.shape[-1]
    dst = host_pages.long().cpu()
    idx = rows.long().to(k.device)
    for i, src in enumerate((k, v)):
        rows_of_pages = src[idx].view(-1, p, H, D).transpose(1, 2).cpu()
        store_host_rows(host_layer, host_scales, (dst, slice(None), i), rows_of_pages)


def naive_staged_to_slots(src_k: torch.Tensor, src_v: torch.Tensor, stage_pages: torch.Tensor, slots: torch.Tensor,
                          req_slots: torch.Tensor, slot_pages: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          page_size: int) -> None:
    """Fill selection slots from pages still staged on the GPU (NHD src_k / src_v [T, H, D]): for every row b, head h
    and slot s whose logical page j = slots[req_slots[b], h, s] is not -1, rows slot_pages[b, s] * p .. + p of head h
    of k / v take rows stage_pages[b, j] * p .. + p of head h of src_k / src_v. stage_pages [B, W], slots [R, H, n],
    slot_pages [B, n]."""
    p = page_size
    t = torch.arange(p, device=k.device)
    for b, r in enumerate(req_slots.tolist()):
        for h, s in (slots[r] >= 0).nonzero().tolist():
            src = int(stage_pages[b, int(slots[r, h, s])]) * p + t
            dst = int(slot_pages[b, s]) * p + t
            k[dst, h] = src_k[src, h].to(k.dtype)
            v[dst, h] = src_v[src, h].to(v.dtype)
