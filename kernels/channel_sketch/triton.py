"""Triton kernel of the channel sketch: per (row, KV head, block of pages) one tensor-core product of the pages'
4-bit codes [tokens, R] with the weights scale * q * step [R, G] shared by every page, then each page's log-sum-exp
over its tokens; page_rerank's pooling kernel turns those into the scores select_slots takes."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._alloc import empty
from .._utils import check_device, check_index_vectors
from ..page_rerank.triton import _full_scan, _pool
from ..page_select.triton import _heads_args
from .naive import BITS, LEVELS


@triton.jit
def _channel_lse_kernel(
    q_ptr, codes_ptr, ch_ptr, step_ptr, pt_ptr, slots_ptr, cend_ptr, heads_ptr, lse_ptr,
    C, cand_start, M, scale,
    sq_b, sq_h, sq_d,
    sc_p, sc_h, sc_t,
    sch_h, sstep_h,
    spt_r, spt_m, s_slot, s_cend,
    sh_b, sh_h,
    sl_b, sl_h, sl_c,
    G: tl.constexpr, GD: tl.constexpr, HALF: tl.constexpr, PAGE: tl.constexpr, NP: tl.constexpr,
    HEADS: tl.constexpr, WANT: tl.constexpr, Q_BY_SLOT: tl.constexpr, LEVELS: tl.constexpr, BITS: tl.constexpr,
):
    """lse[b, h, c, g] of NP pages: [NP p, HALF] low nibbles x [HALF, GD] weights plus the high nibbles' product (query
    heads in the first G columns, GD >= 16 for the product), then the log-sum-exp over each page's p tokens."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    if HEADS:  # noqa: SIM102 (a constexpr branch around a runtime one)
        if tl.load(heads_ptr + b * sh_b + h * sh_h).to(tl.int32) != WANT:
            return
    slot = tl.load(slots_ptr + b * s_slot).to(tl.int64)
    q_row = q_ptr + (slot if Q_BY_SLOT else b) * sq_b + h * G * sq_h
    end = tl.minimum(tl.load(cend_ptr + b * s_cend), M)
    c = tl.program_id(2) * NP + tl.arange(0, NP)
    ok = cand_start + c < end
    page = tl.load(pt_ptr + slot * spt_r + (cand_start + c).to(tl.int64) * spt_m, mask=ok, other=0).to(tl.int64)
    j = tl.arange(0, HALF)
    col = tl.arange(0, GD)
    w_lo = _weights(q_row, ch_ptr + h * sch_h, step_ptr + h * sstep_h, scale, sq_h, sq_d, G, GD, HALF)
    w_hi = _weights(q_row, ch_ptr + h * sch_h + HALF, step_ptr + h * sstep_h + HALF, scale, sq_h, sq_d, G, GD, HALF)
    t = tl.arange(0, PAGE)
    byte = tl.load(codes_ptr + page[:, None, None] * sc_p + h * sc_h + t[None, :, None] * sc_t + j[None, None, :],
                   mask=ok[:, None, None], other=0)
    byte = tl.reshape(byte, [NP * PAGE, HALF]).to(tl.int32)
    acc = tl.dot((byte & (LEVELS - 1)).to(tl.float16), w_lo)
    acc = tl.dot((byte >> BITS).to(tl.float16), w_hi, acc)  # [NP p, GD]
    acc = tl.reshape(acc, [NP, PAGE, GD])
    m = tl.max(acc, axis=1)  # [NP, GD]
    lse = m + tl.log(tl.sum(tl.exp(acc - m[:, None, :]), axis=1))
    lse = tl.where(ok[:, None], lse, float("-inf"))
    tl.store(lse_ptr + b * sl_b + h * sl_h + c[:, None].to(tl.int64) * sl_c + col[None, :], lse,
             mask=(c < C)[:, None] & (col < G)[None, :])


@triton.jit
def _weights(q_row, ch_ptr, step_ptr, scale, sq_h, sq_d, G: tl.constexpr, GD: tl.constexpr, HALF: tl.constexpr):
    """[HALF, GD] fp16: scale * q * step of the group's query heads (columns) on HALF calibrated channels."""
    j = tl.arange(0, HALF)
    col = tl.arange(0, GD)
    ch = tl.load(ch_ptr + j).to(tl.int64)
    step = tl.load(step_ptr + j)
    qv = tl.load(q_row + col[None, :] * sq_h + ch[:, None] * sq_d, mask=(col < G)[None, :], other=0.0)
    return (qv.to(tl.float32) * scale * step[:, None]).to(tl.float16)


CHANNEL_TOKENS = 512  # tokens per program: 512 / p pages, one product of [512, R / 2] x [R / 2, 16] per nibble
CHANNEL_WARPS = 4


def channel_sketch_pages(
    q: torch.Tensor,
    codes: torch.Tensor,
    channels: torch.Tensor,
    step: torch.Tensor,
    page_table: torch.Tensor,
    req_slots: torch.Tensor,
    scale: float,
    heads: torch.Tensor | None = None,
    phase: int = 1,
    q_by_slot: bool = False,
    cand_start: int = 0,
    cand_end: torch.Tensor | None = None,
) -> torch.Tensor:
    """See naive_channel_sketch_pages."""
    check_device(q, codes, channels, step, page_table, req_slots)
    check_index_vectors(req_slots=req_slots)
    B, Hq, D = req_slots.shape[0], q.shape[1], q.shape[2]
    P, H, p, half = codes.shape
    R, M = 2 * half, page_table.shape[1]
    assert Hq % H == 0 and codes.dtype == torch.uint8 and codes.stride(3) == 1 and codes.stride(2) == half
    assert channels.shape == (H, R) and channels.dtype == torch.int32 and channels.stride(1) == 1
    assert step.shape == (H, R) and step.dtype == torch.float32 and step.stride(1) == 1
    assert R % 32 == 0 and R <= D and p >= 16 and p & (p - 1) == 0, "tl.dot needs 16 x 16 operands"
    assert q_by_slot or q.shape[0] == B
    G = Hq // H
    C, cand_args = _full_scan(req_slots, cand_start, cand_end, M)
    heads_args = _heads_args(heads, phase, req_slots)
    heads_arg, heads_strides, with_heads, want = heads_args
    scores = empty(B, H, M, dtype=torch.float32, device=q.device)
    if B * H == 0:
        return scores
    gp = triton.next_power_of_2(G)
    lse = empty(B, H, max(C, 1), gp, dtype=torch.float32, device=q.device)  # scratch
    if C:
        np_ = max(1, CHANNEL_TOKENS // p)
        _channel_lse_kernel[(B, H, triton.cdiv(C, np_))](
            q, codes, channels, step, page_table, req_slots, cand_end, heads_arg, lse,
            C, cand_start, M, scale,
            *q.stride(), codes.stride(0), codes.stride(1), codes.stride(2), channels.stride(0), step.stride(0),
            *page_table.stride(), req_slots.stride(0), cand_end.stride(0), *heads_strides, *lse.stride()[:3],
            G=G, GD=max(16, gp), HALF=half, PAGE=p, NP=np_, HEADS=with_heads, WANT=want, Q_BY_SLOT=q_by_slot,
            LEVELS=LEVELS, BITS=BITS, num_warps=CHANNEL_WARPS,
        )
    _pool(lse, cand_args, False, heads_args, scores, C, cand_start, G)
    return scores
