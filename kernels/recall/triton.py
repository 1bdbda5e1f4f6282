"""Recall: gather the (page, head) chunks a selection phase recalls from the host arena into the GPU pages of their
slots, HND -> NHD, in one zero-copy kernel that reads the slot and page tables itself.

On CUDA `host_layer` is pinned (or cudaHostRegister'ed) host memory; the kernel dereferences it over UVA, so the
gather and the layout transpose cost one PCIe read of each chunk and no staging buffer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..page_select.naive import VICTIM_SHIFT
from .._utils import capped_grid, check_device, check_index_vectors
from .naive import check_victim_args


@triton.jit(do_not_specialize=["B"])
def _recall_pages_kernel(
    host_ptr, k_ptr, v_ptr, pt_ptr, slots_ptr, req_ptr, spages_ptr, recall_ptr, vops_ptr,
    B, H, K, victim_base, V,
    s_hp, s_hh, s_hkv, s_ht,
    s_kt, s_kh, s_vt, s_vh,
    spt_r, spt_m,
    st_r, st_h, st_k,
    s_req,
    sg_b, sg_k,
    sr_b, sr_h, sr_k,
    so_b, so_h, so_k,
    PHASE: tl.constexpr, PAGE: tl.constexpr, D: tl.constexpr, SB: tl.constexpr, NC: tl.constexpr,
    VICTIMS: tl.constexpr, SHIFT: tl.constexpr,
):
    """Work item w = (row b, head h, block of SB slots), blocks fastest; programs stride over the B * H * ceil(K/SB)
    items. Entries of other phases carry garbage indices: every load through them is masked off.

    A block's entries of the phase are gathered NC at a time ([NC, PAGE, D] tiles). Their table lookups (slot, GPU
    page, victim op, host page) are vector loads over the whole block, so a block pays the three dependent index
    round trips once, not once per chunk: inside a decode step HBM latency is high (the GEMMs stream the weights), and
    a program walking its chunks one by one waited on those round trips more than on PCIe."""
    t = tl.arange(0, PAGE).to(tl.int64)[None, :, None]
    d = tl.arange(0, D)[None, None, :]
    j_sb = tl.arange(0, SB)
    c_nc = tl.arange(0, NC)
    NB = tl.cdiv(K, SB)
    for w in range(tl.program_id(0), B * H * NB, tl.num_programs(0)):
        s0 = (w % NB) * SB
        h = (w // NB) % H  # b, h, s times their (index-table or head) strides stay far below 2**31
        b = w // NB // H
        # The block's codes in one vector load, and a branch: a block with no entry of the phase (most of them in a
        # speculative recall) costs that one load.
        s = s0 + j_sb
        codes = tl.load(recall_ptr + b * sr_b + h * sr_h + s * sr_k, mask=s < K, other=0)
        hit = (codes.to(tl.int32) == PHASE) & (s < K)
        n_hit = tl.sum(hit.to(tl.int32), 0)
        if n_hit != 0:
            r = tl.load(req_ptr + b * s_req).to(tl.int64)
            page = tl.load(slots_ptr + r * st_r + h * st_h + s * st_k, mask=hit, other=0).to(tl.int64)
            row0 = tl.load(spages_ptr + b * sg_b + s * sg_k, mask=hit, other=0).to(tl.int64) * PAGE
            evict = tl.full([SB], -1, tl.int64)
            source = tl.full([SB], -1, tl.int64)
            if VICTIMS:
                op = tl.load(vops_ptr + b * so_b + h * so_h + s * so_k, mask=hit, other=0)
                evict = ((op & ((1 << SHIFT) - 1)) - 1).to(tl.int64)
                source = ((op >> SHIFT) - 1).to(tl.int64)
            src = tl.load(pt_ptr + r * spt_r + page * spt_m, mask=hit & (source < 0), other=0).to(tl.int64)
            rank = tl.cumsum(hit.to(tl.int32), 0) - 1  # an entry's place among the block's entries of the phase
            for g in range(0, n_hit, NC):
                pick = hit[None, :] & (rank[None, :] == (g + c_nc)[:, None])  # [NC, SB]: one entry per row or none
                live = g + c_nc < n_hit
                dst_row = tl.sum(tl.where(pick, row0[None, :], 0), 1)[:, None, None]
                c_src = tl.sum(tl.where(pick, src[None, :], 0), 1)[:, None, None]
                c_source = tl.sum(tl.where(pick, source[None, :], 0), 1)[:, None, None]
                c_evict = tl.sum(tl.where(pick, evict[None, :], 0), 1)[:, None, None]
                on = live[:, None, None]
                k_dst = k_ptr + (dst_row + t) * s_kt + h * s_kh + d
                v_dst = v_ptr + (dst_row + t) * s_vt + h * s_vh + d
                # Host chunks: K and V tiles of all NC entries are issued before any store, so a program keeps
                # NC * 2 * PAGE * D elements in flight over PCIe.
                chunk = host_ptr + c_src * s_hp + h * s_hh + t * s_ht + d
                from_host = on & (c_source < 0)
                k = tl.load(chunk, mask=from_host)
                v = tl.load(chunk + s_hkv, mask=from_host)
                if VICTIMS:
                    hit_row = (victim_base + r * V + c_source) * PAGE
                    from_victim = on & (c_source >= 0)
                    k = tl.where(from_victim, tl.load(k_ptr + (hit_row + t) * s_kt + h * s_kh + d, mask=from_victim), k)
                    v = tl.where(from_victim, tl.load(v_ptr + (hit_row + t) * s_vt + h * s_vh + d, mask=from_victim), v)
                    # The outgoing chunks to their victim entries, HBM to HBM, while the incoming ones are in flight;
                    # every thread's read of a slot precedes any write to it. No entry of the head reads an entry
                    # that another of its entries evicts into (select_slots reserves them): groups need no order.
                    out = on & (c_evict >= 0)
                    e0 = (victim_base + r * V + c_evict) * PAGE
                    k_out = tl.load(k_dst, mask=out)
                    v_out = tl.load(v_dst, mask=out)
                    tl.store(k_ptr + (e0 + t) * s_kt + h * s_kh + d, k_out, mask=out)
                    tl.store(v_ptr + (e0 + t) * s_vt + h * s_vh + d, v_out, mask=out)
                    tl.debug_barrier()
                tl.store(k_dst, k, mask=on)
                tl.store(v_dst, v, mask=on)


def recall_pages(
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
    inflight: int = 1,
) -> None:
    """For each (b, h, s) with recall[b, h, s] == phase, r = req_slots[b]: the host page
    page_table[r, slots[r, h, s]] of head h goes to rows slot_pages[b, s]*p .. +p, head h, of k_cache / v_cache.

    programs == 0: one program per (b, h, s) item, for the recall on the critical path. programs > 0 caps the
    programs launched, each striding over whole (b, h) rows of K slots: a speculative recall running beside the
    model's GEMMs then holds a few SMs during its PCIe reads instead of one CTA per item, and a row without an
    entry of the phase (most of them) costs one vector load of its codes, not K dependent byte loads.
    slot_block > 0 (a power of two) sets the work item to (b, h, block of that many slots) instead, whatever the
    programs: smaller blocks spread a row's entries over more programs (benchmarks/kernels.py --recall-blocks).
    victim_ops, victim_base, victim_entries: the victim cache's moves, as in naive_recall_pages.
    inflight (a power of two): chunks a program gathers at once from a block's entries (at most the block's slots;
    a one-slot item has one).
    """
    check_device(host_layer, k_cache, v_cache, page_table, slots, req_slots, slot_pages, recall)
    check_index_vectors(req_slots=req_slots)
    B, H, K = recall.shape
    D = host_layer.shape[-1]
    assert v_cache.shape == k_cache.shape and k_cache.shape[1:] == (host_layer.shape[1], D) and H == k_cache.shape[1]
    assert host_layer.shape[2:] == (2, page_size, D)
    assert host_layer.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    assert slots.shape[1:] == (H, K) and req_slots.shape == (B,) and slot_pages.shape == (B, K)
    check_victim_args(victim_ops, recall, victim_base, victim_entries, k_cache, page_size, slots.shape[0])
    if victim_ops is not None:
        check_device(victim_ops)
    if slot_block < 0 or slot_block & (slot_block - 1):
        raise ValueError(f"slot_block must be 0 or a power of two, got {slot_block!r}")
    if not isinstance(inflight, int) or inflight < 1 or inflight & (inflight - 1):
        raise ValueError(f"inflight must be a power of two, got {inflight!r}")
    if B * H * K == 0:
        return
    sb = slot_block or (triton.next_power_of_2(K) if programs > 0 else 1)
    nc = min(inflight, sb)
    _recall_pages_kernel[capped_grid(B * H * triton.cdiv(K, sb), programs)](
        host_layer, k_cache, v_cache, page_table, slots, req_slots, slot_pages, recall,
        recall if victim_ops is None else victim_ops,
        B, H, K, victim_base, max(victim_entries, 1),
        host_layer.stride(0), host_layer.stride(1), host_layer.stride(2), host_layer.stride(3),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        *page_table.stride(), *slots.stride(), req_slots.stride(0), *slot_pages.stride(), *recall.stride(),
        *(recall if victim_ops is None else victim_ops).stride(),
        PHASE=phase, PAGE=page_size, D=D, SB=sb, NC=nc, VICTIMS=victim_ops is not None,
        SHIFT=VICTIM_SHIFT, num_warps=4 if nc == 1 else 8,  # 8 warps hold two or more [PAGE, D] tiles per K and V
    )
