"""Recall: gather the (page, head) chunks a selection phase recalls from the host arena into the GPU pages of their
slots, HND -> NHD, in one zero-copy kernel that reads the slot and page tables itself.

On CUDA `host_layer` is pinned (or cudaHostRegister'ed) host memory; the kernel dereferences it over UVA, so the
gather and the layout transpose cost one PCIe read of each chunk and no staging buffer. An FP8 arena's chunk is half
the bytes, plus its p row exponents; it is widened on the GPU (freekv_kernels.fp8_rows).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..fp8_rows.naive import check_host_scales
from ..fp8_rows.triton import dequantize_tile
from ..page_select.naive import VICTIM_SHIFT
from .._utils import capped_grid, check_device, check_index_vectors
from .naive import check_victim_args

# Warps a recall program: 145 registers a thread at 4 on sm_90 (a speculative program), ~18.5K a CTA; programs of
# 8-16 warps cost the model's kernels more beside them (session 54). benchmarks/side_lanes.py --warps recall=N times
# others.
RECALL_WARPS = 4


@triton.jit(do_not_specialize=["B"])
def _recall_pages_kernel(
    host_ptr, exp_ptr, k_ptr, v_ptr, pt_ptr, slots_ptr, req_ptr, spages_ptr, recall_ptr, vops_ptr,
    B, H, K, victim_base, V,
    s_hp, s_hh, s_hkv, s_ht,
    s_ep, s_eh, s_ekv, s_et,
    s_kt, s_kh, s_vt, s_vh,
    spt_r, spt_m,
    st_r, st_h, st_k,
    s_req,
    sg_b, sg_k,
    sr_b, sr_h, sr_k,
    so_b, so_h, so_k,
    PHASE: tl.constexpr, PAGE: tl.constexpr, D: tl.constexpr, SB: tl.constexpr, VICTIMS: tl.constexpr,
    SHIFT: tl.constexpr, SCALED: tl.constexpr,
):
    """Work item w = (row b, head h, block of SB slots), blocks fastest; programs stride over the B * H * ceil(K/SB)
    items. Entries of other phases carry garbage indices: they are skipped before any of those is read."""
    t = tl.arange(0, PAGE).to(tl.int64)[:, None]
    d = tl.arange(0, D)[None, :]
    j_sb = tl.arange(0, SB)
    NB = tl.cdiv(K, SB)
    for w in range(tl.program_id(0), B * H * NB, tl.num_programs(0)):
        s0 = (w % NB) * SB
        h = (w // NB) % H  # b, h, s times their (index-table or head) strides stay far below 2**31
        b = w // NB // H
        # The block's codes in one vector load, and a branch: a block with no entry of the phase (most of them in a
        # speculative recall) costs that one load, not one dependent byte load per slot.
        in_k = s0 + j_sb < K
        codes = tl.load(recall_ptr + b * sr_b + h * sr_h + (s0 + j_sb) * sr_k, mask=in_k, other=0)
        hit = ((codes.to(tl.int32) == PHASE) & in_k).to(tl.int32)
        if tl.max(hit, 0) != 0:
            # The block's table entries in a few vector loads, once: each slot then waits on its chunk alone, not on
            # its own chain of dependent loads (request, page, host page) before it. The capped speculative recall
            # walks a row's slots one after another (session 51: ~6.8 µs a slot a program).
            r = tl.load(req_ptr + b * s_req).to(tl.int64)
            on = hit != 0
            s_vec = s0 + j_sb
            dsts = tl.load(spages_ptr + b * sg_b + s_vec * sg_k, mask=on, other=0).to(tl.int64) * PAGE
            pages = tl.load(slots_ptr + r * st_r + h * st_h + s_vec * st_k, mask=on, other=0).to(tl.int64)
            ops = tl.zeros([SB], dtype=tl.int32)
            if VICTIMS:
                ops = tl.load(vops_ptr + b * so_b + h * so_h + s_vec * so_k, mask=on, other=0)
            srcs = tl.load(pt_ptr + r * spt_r + pages * spt_m, mask=on & ((ops >> SHIFT) <= 0), other=0).to(tl.int64)
            for j in range(SB):
                # This slot's entries from the registers.
                mine = j_sb == j
                if tl.sum(tl.where(mine, hit, 0), 0) != 0:
                    row0 = tl.sum(tl.where(mine, dsts, 0), 0)
                    k_dst = k_ptr + (row0 + t) * s_kt + h * s_kh + d
                    v_dst = v_ptr + (row0 + t) * s_vt + h * s_vh + d
                    source = -1
                    evict = -1
                    if VICTIMS:
                        op = tl.sum(tl.where(mine, ops, 0), 0)
                        evict = (op & ((1 << SHIFT) - 1)) - 1
                        source = (op >> SHIFT) - 1
                    if source >= 0:
                        e1 = (victim_base + r * V + source) * PAGE
                        k = tl.load(k_ptr + (e1 + t) * s_kt + h * s_kh + d)
                        v = tl.load(v_ptr + (e1 + t) * s_vt + h * s_vh + d)
                    else:
                        src = tl.sum(tl.where(mine, srcs, 0), 0)
                        # One [PAGE, D] tile per K and V: both loads are issued before either store, so each item
                        # keeps the whole 2*PAGE*D chunk in flight over PCIe (wide vector loads, several per thread).
                        chunk = host_ptr + src * s_hp + h * s_hh + t * s_ht + d
                        if SCALED:
                            rows_e = exp_ptr + src * s_ep + h * s_eh + tl.arange(0, PAGE).to(tl.int64) * s_et
                            kq = tl.load(chunk)
                            vq = tl.load(chunk + s_hkv)
                            k = dequantize_tile(kq, tl.load(rows_e)).to(k_ptr.dtype.element_ty)
                            v = dequantize_tile(vq, tl.load(rows_e + s_ekv)).to(v_ptr.dtype.element_ty)
                        else:
                            k = tl.load(chunk)
                            v = tl.load(chunk + s_hkv)
                    if evict >= 0:
                        # The outgoing chunk to its victim entry, HBM to HBM, while the incoming one is in flight;
                        # every thread's read of the slot precedes any write to it.
                        e0 = (victim_base + r * V + evict) * PAGE
                        k_out = tl.load(k_dst)
                        v_out = tl.load(v_dst)
                        tl.store(k_ptr + (e0 + t) * s_kt + h * s_kh + d, k_out)
                        tl.store(v_ptr + (e0 + t) * s_vt + h * s_vh + d, v_out)
                        tl.debug_barrier()
                    tl.store(k_dst, k)
                    tl.store(v_dst, v)


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
    host_scales: torch.Tensor | None = None,
) -> None:
    """For each (b, h, s) with recall[b, h, s] == phase, r = req_slots[b]: the host page
    page_table[r, slots[r, h, s]] of head h goes to rows slot_pages[b, s]*p .. +p, head h, of k_cache / v_cache
    (widened with its row exponents host_scales [N, H, 2, p] from an FP8 host_layer).

    programs == 0: one program per (b, h, s) item, for the recall on the critical path. programs > 0 caps the
    programs launched, each striding over whole (b, h) rows of K slots: a speculative recall running beside the
    model's GEMMs then holds a few SMs during its PCIe reads instead of one CTA per item, and a row without an
    entry of the phase (most of them) costs one vector load of its codes, not K dependent byte loads.
    slot_block > 0 (a power of two) sets the work item to (b, h, block of that many slots) instead, whatever the
    programs: smaller blocks spread a row's entries over more programs (benchmarks/kernels.py --recall-blocks).
    victim_ops, victim_base, victim_entries: the victim cache's moves, as in naive_recall_pages.
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
    if check_host_scales(host_layer, host_scales):
        check_device(host_scales)
    scaled = host_scales is not None
    if victim_ops is not None:
        check_device(victim_ops)
    if slot_block < 0 or slot_block & (slot_block - 1):
        raise ValueError(f"slot_block must be 0 or a power of two, got {slot_block!r}")
    if B * H * K == 0:
        return
    sb = slot_block or (triton.next_power_of_2(K) if programs > 0 else 1)
    _recall_pages_kernel[capped_grid(B * H * triton.cdiv(K, sb), programs)](
        host_layer, host_scales if scaled else recall, k_cache, v_cache, page_table, slots, req_slots, slot_pages,
        recall, recall if victim_ops is None else victim_ops,
        B, H, K, victim_base, max(victim_entries, 1),
        host_layer.stride(0), host_layer.stride(1), host_layer.stride(2), host_layer.stride(3),
        *(host_scales.stride() if scaled else (0, 0, 0, 0)),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        *page_table.stride(), *slots.stride(), req_slots.stride(0), *slot_pages.stride(), *recall.stride(),
        *(recall if victim_ops is None else victim_ops).stride(),
        PHASE=phase, PAGE=page_size, D=D, SB=sb, VICTIMS=victim_ops is not None, SHIFT=VICTIM_SHIFT,
        SCALED=scaled, num_warps=RECALL_WARPS,
    )
