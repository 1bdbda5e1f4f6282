"""Torch reference for recall_pages: copy the (page, head) chunks a selection phase recalls from the HND host arena
into the NHD GPU pages of their slots."""

from __future__ import annotations

import torch


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
) -> None:
    """For each (b, h, s) with recall[b, h, s] == phase, r = req_slots[b]: the host page
    page_table[r, slots[r, h, s]] of head h goes to rows slot_pages[b, s]*p .. +p, head h, of k_cache / v_cache.
    `programs` and `slot_block` shape the Triton launch only."""
    p = page_size
    rows = req_slots.tolist()
    for b, h, s in (recall == phase).nonzero().tolist():
        r = rows[b]
        src = int(page_table[r, int(slots[r, h, s])])
        dst = int(slot_pages[b, s])
        k_cache[dst * p:(dst + 1) * p, h].copy_(host_layer[src, h, 0])
        v_cache[dst * p:(dst + 1) * p, h].copy_(host_layer[src, h, 1])
