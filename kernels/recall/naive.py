"""Torch reference for recall_pages: copy the (page, head) chunks a selection phase recalls from the HND host arena
(or from a victim entry on the GPU) into the NHD GPU pages of their slots."""

from __future__ import annotations

import torch

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


def check_hold(raise_hold: torch.Tensor | None, wait_hold: torch.Tensor | None) -> None:
    """The hold flag's arguments. A flag to wait on that is already raised on the CPU, where kernels run in program
    order and nothing could lower it, would wait forever: refused (on CUDA reading it would stall the stream)."""
    if raise_hold is not None and wait_hold is not None:
        raise ValueError("a recall either raises the hold flag or waits on it, not both")
    for flag in (raise_hold, wait_hold):
        if flag is not None and (flag.shape != (1,) or flag.dtype != torch.int32):
            raise ValueError(f"the hold flag is one int32, got {tuple(flag.shape)} {flag.dtype}")
    if wait_hold is not None and not wait_hold.is_cuda and int(wait_hold) != 0:
        raise ValueError("the hold flag is raised and nothing runs beside this recall to lower it: it would wait "
                         "forever")


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
    raise_hold: torch.Tensor | None = None,
    wait_hold: torch.Tensor | None = None,
) -> None:
    """For each (b, h, s) with recall[b, h, s] == phase, r = req_slots[b]: the host page
    page_table[r, slots[r, h, s]] of head h goes to rows slot_pages[b, s]*p .. +p, head h, of k_cache / v_cache.
    With victim_ops (select_slots' victim cache; V = victim_entries, entry e of request slot r in GPU page
    victim_base + r * V + e): first the slot's outgoing chunk goes to its evict entry, if any; the incoming chunk
    then comes from its source entry instead of the host, if it has one. `programs` and `slot_block` shape the
    Triton launch only. raise_hold / wait_hold: the hold flag (recall_pages); run in program order, waiting on it
    is its check."""
    check_victim_args(victim_ops, recall, victim_base, victim_entries, k_cache, page_size, slots.shape[0])
    check_hold(raise_hold, wait_hold)
    p = page_size
    rows = req_slots.tolist()
    items = (recall == phase).nonzero().tolist()
    if raise_hold is not None and items:
        raise_hold.fill_(1)
    for b, h, s in items:
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
        k_cache[dst * p:(dst + 1) * p, h].copy_(host_layer[src, h, 0])
        v_cache[dst * p:(dst + 1) * p, h].copy_(host_layer[src, h, 1])
