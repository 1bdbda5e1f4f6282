"""Torch reference for recall_pages: copy the (page, head) chunks a selection phase recalls from the HND host arena
(or from a victim entry on the GPU) into the NHD GPU pages of their slots."""

from __future__ import annotations

import torch

from ..fp8_rows.naive import check_host_scales, host_rows
from ..page_select.naive import unpack_victim_op


def check_victim_args(victim_ops: torch.Tensor | None, recall: torch.Tensor, victim_base: int, victim_entries: int,
                      k_cache: torch.Tensor, page_size: int, num_slots: int) -> None:
    if victim_ops is None:
        return
    assert victim_ops.shape == recall.shape and victim_ops.dtype == torch.int32
    end = (victim_base + num_slots * victim_entries) * page_size
    if victim_entries < 1 or victim_base < 0 or end > k_cache.shape[0]:
        raise ValueError(f"victim pages [{victim_base}, +{num_slots} x {victim_entries}) do not fit the GPU pool "
                         f"of {k_cache.shape[0] // page_size} pages")


def naive_recall_pages(
    host_layer: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    slots: torch.Tensor,
    req_slots: torch.Tensor,
    slot_pages: torch.Tensor,
    recall: torch.Tensor,
    phase: int,
    page_size: int,
    programs: int = 0,
    slot_block: int = 0,
    victim_ops: torch.Tensor | None = None,
    victim_base: int = 0,
    victim_entries: int = 0,
    host_scales: torch.Tensor | None = None,
) -> None:
    """For each (b, h, s) with recall[b, h, s] == phase, r = req_slots[b]: the host page
    page_table[r, slots[r, h, s]] of head h goes to rows slot_pages[b, s]*p .. +p, head h, of k_cache / v_cache.
    With victim_ops (select_slots' victim cache; V = victim_entries, entry e of request slot r in GPU page
    victim_base + r * V + e): first the slot's outgoing chunk goes to its evict entry, if any; the incoming chunk
    then comes from its source entry instead of the host, if it has one. An FP8 host_layer's chunks are widened with
    their row exponents host_scales [N, H, 2, p] (freekv_kernels.fp8_rows). `programs` and `slot_block` shape the
    Triton launch only."""
    check_victim_args(victim_ops, recall, victim_base, victim_entries, k_cache, page_size, slots.shape[0])
    check_host_scales(host_layer, host_scales)
    p = page_size
    rows = req_slots.tolist()
    for b, h, s in (recall == phase).nonzero().tolist():
        r = rows[b]
        dst = int(slot_pages[b, s])
        evict, source = unpack_victim_op(int(victim_ops[b, h, s])) if victim_ops is not None else (-1, -1)
        if evict >= 0:
            e = victim_base + r * victim_entries + evict
            k_cache[e * p:(e + 1) * p, h].copy_(k_cache[dst * p:(dst + 1) * p, h])
            v_cache[e * p:(e + 1) * p, h].copy_(v_cache[dst * p:(dst + 1) * p, h])
        if source >= 0:
            e = victim_base + r * victim_entries + source
            k_cache[dst * p:(dst + 1) * p, h].copy_(k_cache[e * p:(e + 1) * p, h])
            v_cache[dst * p:(dst + 1) * p, h].copy_(v_cache[e * p:(e + 1) * p, h])
            continue
        src = int(page_table[r, int(slots[r, h, s])])
        k_cache[dst * p:(dst + 1) * p, h].copy_(host_rows(host_layer, host_scales, (src, h, 0), k_cache.dtype))
        v_cache[dst * p:(dst + 1) * p, h].copy_(host_rows(host_layer, host_scales, (src, h, 1), v_cache.dtype))
