"""Triton kernels of the two-stage selection from 2-bit key codes: the sketch, the top candidates, their rerank.

sketch_pages: the first stage: per (row, KV head) the code bytes the query weighs most (_sketch_picks_kernel), then
every page scored from its mid-range and those bytes (_sketch_lse_kernel), pooled like the rerank.
top_pages: the staged bitonic top-k of select_slots (same packed keys, same tie order), ending in page ids.
rerank_pages: one kernel computes, per (row, KV head, block of candidates), each candidate page's log-sum-exp of
its decoded-key logits for the G query heads: the page's min / max summary and p * D / 4 code bytes, decoded
per channel and multiplied with the query on tensor cores (see _rerank_lse_kernel);
a second kernel per (row, KV head) takes the softmax of those log-sum-exps over the candidates per query head,
their group mean, and writes the row of scores (-inf off the candidates) that select_slots takes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._alloc import empty
from .._utils import check_device, check_index_vectors
from ..page_select.triton import (
    _NEG_INF_KEY,
    TOPK_CHUNK,
    TOPK_SINGLE,
    TOPK_WARPS,
    _heads_args,
    _sort_keys,
    _topk_kernel,
)
from .naive import CODE_BITS, LEVELS, PER_BYTE


@triton.jit
def _top_pages_kernel(
    in_ptr, out_ptr, heads_ptr, n, H, NUM,
    si_b, si_h, si_j,
    so_b, so_h, so_c,
    sh_b, sh_h,
    KP: tl.constexpr, CHUNK: tl.constexpr, PACKED_IN: tl.constexpr, HEADS: tl.constexpr, WANT: tl.constexpr,
    NEG_INF_KEY: tl.constexpr,
):
    pid = tl.program_id(0)
    b = (pid // H).to(tl.int64)
    h = (pid % H).to(tl.int64)
    if HEADS:  # noqa: SIM102 (a constexpr branch around a runtime one)
        if tl.load(heads_ptr + b * sh_b + h * sh_h).to(tl.int32) != WANT:
            return
    top = tl.topk(_sort_keys(in_ptr, b, h, n, si_b, si_h, si_j, 0, CHUNK, PACKED_IN, NEG_INF_KEY), KP)
    i = tl.arange(0, KP)
    page = 0x7FFFFFFF - top.to(tl.int32)
    sel = tl.where(((top >> 32).to(tl.int32) <= NEG_INF_KEY), -1, page)
    tl.store(out_ptr + b * so_b + h * so_h + i.to(tl.int64) * so_c, sel, mask=i < NUM)


def top_pages(scores: torch.Tensor, num: int, heads: torch.Tensor | None = None, phase: int = 1) -> torch.Tensor:
    """See naive_top_pages."""
    check_device(scores)
    B, H, M = scores.shape
    heads_arg, heads_strides, with_heads, want = _heads_args(heads, phase, scores)
    out = empty(B, H, num, dtype=torch.int32, device=scores.device)
    if B * H == 0 or num == 0:
        return out
    kp = max(2, triton.next_power_of_2(num))
    chunk = max(TOPK_CHUNK, 2 * kp)
    x, n, packed = scores, M, False
    while (width := max(triton.next_power_of_2(max(n, 1)), kp)) > max(TOPK_SINGLE, chunk):
        n_chunks = triton.cdiv(n, chunk)
        cand = torch.empty(B, H, n_chunks * kp, dtype=torch.int64, device=scores.device)  # scratch
        # Early stages score every head (their kernel has no phase switch); the last stage writes the phase's.
        _topk_kernel[(B * H, n_chunks)](
            x, cand, heads_arg if with_heads else torch.ones(B, H, dtype=torch.bool, device=scores.device), n, H,
            *x.stride(), *cand.stride(), *(heads_strides if with_heads else (H, 1)),
            out, out, 0, 0, 0, 0, 0, 1.0,  # no hysteresis: no slot table
            KP=kp, CHUNK=chunk, PACKED_IN=packed, WANT=want if with_heads else 1, NEG_INF_KEY=_NEG_INF_KEY,
            HYST=False,
            num_warps=TOPK_WARPS,
        )
        x, n, packed = cand, n_chunks * kp, True
    _top_pages_kernel[(B * H,)](
        x, out, heads_arg, n, H, num, *x.stride(), *out.stride(), *heads_strides,
        KP=kp, CHUNK=width, PACKED_IN=packed, HEADS=with_heads, WANT=want, NEG_INF_KEY=_NEG_INF_KEY,
        num_warps=TOPK_WARPS,
    )
    return out


@triton.jit
def _rerank_lse_kernel(
    q_ptr, summ_ptr, codes_ptr, pt_ptr, slots_ptr, cand_ptr, cend_ptr, heads_ptr, lse_ptr,
    C, cand_start, M, scale,
    sq_b, sq_h, sq_d,
    ss_p, ss_h, ss_mm,
    sc_p, sc_h, sc_t, sc_j,
    spt_r, spt_m, s_slot, s_cend,
    scd_b, scd_h, scd_c,
    sh_b, sh_h,
    sl_b, sl_h, sl_c,
    G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, BLOCK_C: tl.constexpr,
    HEADS: tl.constexpr, WANT: tl.constexpr, Q_BY_SLOT: tl.constexpr, CAND_LIST: tl.constexpr,
    LEVELS: tl.constexpr, BITS: tl.constexpr, PER_BYTE: tl.constexpr, KP: tl.constexpr,
):
    """lse[b, h, c, g] for the BLOCK_C candidates c of one block: log-sum-exp over the page's p tokens of the
    logits of query head g with the decoded keys (-inf for no candidate: -1 in the list, or past the row's end).
    Code byte j holds channels PER_BYTE * j + i at bits BITS * i, so the loaded [p, D / 4] bytes give, per shift
    i, a [p, D / 4] tile of channels i, i + 4, ...: each decodes elementwise (c * step + centre, one FMA, to fp16)
    and meets the matching rows of the scaled query, [D / 4, GP] fp16 held for every page, in a tensor-core
    product. Nothing per page is reshaped or rebuilt but the decode."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    if HEADS:  # noqa: SIM102 (a constexpr branch around a runtime one)
        if tl.load(heads_ptr + b * sh_b + h * sh_h).to(tl.int32) != WANT:
            return
    slot = tl.load(slots_ptr + b * s_slot).to(tl.int64)
    q_row = slot if Q_BY_SLOT else b
    end = M
    if not CAND_LIST:
        end = tl.minimum(tl.load(cend_ptr + b * s_cend), M)
    g = tl.arange(0, GP)
    j = tl.arange(0, KP)  # code byte within a token's row; channels PER_BYTE * j + i
    j_ok = j < D // PER_BYTE
    t = tl.arange(0, PAGE).to(tl.int64)
    q_base = q_ptr + q_row * sq_b + (h * G + g[None, :]) * sq_h
    q_ok = j_ok[:, None] & (g < G)[None, :]
    # [KP, GP] per shift: the query's channels PER_BYTE * j + i, scaled, rounded to fp16 once.
    q0 = (tl.load(q_base + (PER_BYTE * j[:, None] + 0) * sq_d, mask=q_ok, other=0.0).to(tl.float32) * scale)
    q1 = (tl.load(q_base + (PER_BYTE * j[:, None] + 1) * sq_d, mask=q_ok, other=0.0).to(tl.float32) * scale)
    q2 = (tl.load(q_base + (PER_BYTE * j[:, None] + 2) * sq_d, mask=q_ok, other=0.0).to(tl.float32) * scale)
    q3 = (tl.load(q_base + (PER_BYTE * j[:, None] + 3) * sq_d, mask=q_ok, other=0.0).to(tl.float32) * scale)
    q0, q1, q2, q3 = q0.to(tl.float16), q1.to(tl.float16), q2.to(tl.float16), q3.to(tl.float16)
    for i in tl.static_range(BLOCK_C):
        c = tl.program_id(2) * BLOCK_C + i
        if CAND_LIST:
            logical = tl.load(cand_ptr + b * scd_b + h * scd_h + c * scd_c, mask=c < C, other=-1)
        else:
            logical = tl.where(cand_start + c < end, cand_start + c, -1)
        if logical >= 0:
            page = tl.load(pt_ptr + slot * spt_r + logical.to(tl.int64) * spt_m).to(tl.int64)
            byte = tl.load(codes_ptr + page * sc_p + h * sc_h + t[:, None] * sc_t + j[None, :] * sc_j,
                           mask=j_ok[None, :], other=0).to(tl.int32)  # [PAGE, KP]
            summ = summ_ptr + page * ss_p + h * ss_h + PER_BYTE * j
            acc = tl.zeros([PAGE, GP], tl.float32)
            acc = _rerank_shift(acc, byte, summ, ss_mm, j_ok, q0, 0, LEVELS, BITS)
            acc = _rerank_shift(acc, byte, summ, ss_mm, j_ok, q1, 1, LEVELS, BITS)
            acc = _rerank_shift(acc, byte, summ, ss_mm, j_ok, q2, 2, LEVELS, BITS)
            acc = _rerank_shift(acc, byte, summ, ss_mm, j_ok, q3, 3, LEVELS, BITS)
            s = tl.where((g < G)[None, :], acc, float("-inf"))
            m = tl.max(s, axis=0)
            m_safe = tl.where(m == float("-inf"), 0.0, m)
            lse = m_safe + tl.log(tl.sum(tl.exp(s - m_safe[None, :]), axis=0))
            tl.store(lse_ptr + b * sl_b + h * sl_h + c * sl_c + g, lse, mask=g < G)
        elif c < C:
            tl.store(lse_ptr + b * sl_b + h * sl_h + c * sl_c + g, tl.full([GP], float("-inf"), tl.float32),
                     mask=g < G)


@triton.jit
def _rerank_shift(acc, byte, summ, ss_mm, j_ok, q, i: tl.constexpr, LEVELS: tl.constexpr, BITS: tl.constexpr):
    """acc + the decoded keys of channels PER_BYTE * j + i [PAGE, KP] (fp16) times q [KP, GP]."""
    lo = tl.load(summ + i, mask=j_ok, other=0.0).to(tl.float32)
    step = (tl.load(summ + ss_mm + i, mask=j_ok, other=0.0).to(tl.float32) - lo) / LEVELS
    centre = lo + step * 0.5
    code = ((byte >> (BITS * i)) & (LEVELS - 1)).to(tl.float32)
    key = (code * step[None, :] + centre[None, :]).to(tl.float16)
    return tl.dot(key, q, acc)


@triton.jit
def _page_block(q_ptr, pt_ptr, slots_ptr, cend_ptr, b, h, cand_start, M, sq_b, sq_h, spt_r, spt_m, s_slot, s_cend,
                G: tl.constexpr, NP: tl.constexpr, Q_BY_SLOT: tl.constexpr):
    """A full-scan page kernel's block (program_id(2)) of (row b, KV head h): the row's request slot, the group's
    query row (by slot or by row), the NP candidate indices c, whether each is before the row's candidate end, and
    its host page (0 where not)."""
    slot = tl.load(slots_ptr + b * s_slot).to(tl.int64)
    q_row = q_ptr + (slot if Q_BY_SLOT else b) * sq_b + h * G * sq_h
    end = tl.minimum(tl.load(cend_ptr + b * s_cend), M)
    c = tl.program_id(2) * NP + tl.arange(0, NP)
    ok = cand_start + c < end
    page = tl.load(pt_ptr + slot * spt_r + (cand_start + c).to(tl.int64) * spt_m, mask=ok, other=0).to(tl.int64)
    return slot, q_row, c, ok, page


@triton.jit
def _sketch_picks_kernel(
    q_ptr, slots_ptr, heads_ptr, sel_ptr, qp_ptr, scale,
    sq_b, sq_h, sq_d, s_slot, sh_b, sh_h, ssel_b, ssel_h, sqp_b, sqp_h, sqp_c,
    G: tl.constexpr, GP: tl.constexpr, KB: tl.constexpr, NB: tl.constexpr, HEADS: tl.constexpr,
    WANT: tl.constexpr, Q_BY_SLOT: tl.constexpr, PER_BYTE: tl.constexpr,
):
    """Per (row, KV head), once for all its page blocks: sel[r], the NB code bytes with the group's largest sums of
    |q| over their channels (largest first, ties by the lower byte: an argmax per pick), and qp[g, PER_BYTE r + i],
    the scaled query of head g on channel PER_BYTE sel[r] + i, rounded to fp16. One warp: no barriers."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    if HEADS:  # noqa: SIM102 (a constexpr branch around a runtime one)
        if tl.load(heads_ptr + b * sh_b + h * sh_h).to(tl.int32) != WANT:
            return
    slot = tl.load(slots_ptr + b * s_slot).to(tl.int64)
    q_row = q_ptr + (slot if Q_BY_SLOT else b) * sq_b + h * G * sq_h
    jb = tl.arange(0, KB)
    i4 = tl.arange(0, PER_BYTE)
    g = tl.arange(0, GP)
    w = tl.zeros([KB], tl.float32)
    for gg in tl.static_range(G):
        w += tl.sum(tl.abs(tl.load(q_row + gg * sq_h + (PER_BYTE * jb[:, None] + i4[None, :]) * sq_d)
                           .to(tl.float32)), axis=1)
    for r in tl.static_range(NB):
        best = tl.argmax(w, 0)
        w = tl.where(jb == best, -1.0, w)
        tl.store(sel_ptr + b * ssel_b + h * ssel_h + r, best)
        qv = tl.load(q_row + g[:, None] * sq_h + (PER_BYTE * best + i4[None, :]) * sq_d, mask=(g < G)[:, None],
                     other=0.0)
        qv = (qv.to(tl.float32) * scale).to(tl.float16).to(tl.float32)
        tl.store(qp_ptr + b * sqp_b + h * sqp_h + g[:, None] + (PER_BYTE * r + i4[None, :]) * sqp_c, qv)


@triton.jit
def _sketch_lse_kernel(
    q_ptr, summ_ptr, words_ptr, pt_ptr, slots_ptr, cend_ptr, heads_ptr, sel_ptr, qp_ptr, lse_ptr,
    C, cand_start, M, scale,
    sq_b, sq_h, sq_d,
    ss_p, ss_h, ss_mm,
    sw_p, sw_h, sw_j, sw_w,
    spt_r, spt_m, s_slot, s_cend,
    sh_b, sh_h,
    ssel_b, ssel_h, sqp_b, sqp_h, sqp_c,
    sl_b, sl_h, sl_c,
    G: tl.constexpr, GP: tl.constexpr, LOG_GP: tl.constexpr, GD: tl.constexpr, D: tl.constexpr,
    NB: tl.constexpr, PAGE: tl.constexpr, NP: tl.constexpr, HEADS: tl.constexpr, WANT: tl.constexpr,
    Q_BY_SLOT: tl.constexpr, LEVELS: tl.constexpr, BITS: tl.constexpr, PER_BYTE: tl.constexpr,
    PICKS_BY_SLOT: tl.constexpr,
):
    """lse[b, h, c, g] of the first stage for NP pages. Every channel counts at its page's mid-range, the picked
    code bytes (_sketch_picks_kernel's by row, or query_similarity's by request slot) refine their channels to the
    decoded keys: logit = q . mid + sum over the picked channels of q * step * (code - 1.5). The mid-range term is
    a tensor-core product over all D channels; the refinement is plain FMAs with a page's tokens in the registers of
    one or two threads (a picked byte's row of a page is PAGE / 4 contiguous words of 4 tokens), so the sum over
    channels and most of the log-sum-exp over tokens stay in registers, and nothing but the log-sum-exp's last step
    waits on another thread."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    if HEADS:  # noqa: SIM102 (a constexpr branch around a runtime one)
        if tl.load(heads_ptr + b * sh_b + h * sh_h).to(tl.int32) != WANT:
            return
    slot, q_row, c, ok, page = _page_block(q_ptr, pt_ptr, slots_ptr, cend_ptr, b, h, cand_start, M, sq_b, sq_h,
                                           spt_r, spt_m, s_slot, s_cend, G, NP, Q_BY_SLOT)
    summ = summ_ptr + page * ss_p + h * ss_h  # [NP]
    g = tl.arange(0, GP)
    # Mid-range term: [NP, D] x [D, GD] twice (query heads in the first G columns, GD >= 16 for the product).
    d = tl.arange(0, D)
    col = tl.arange(0, GD)
    q_t = tl.load(q_row + col[None, :] * sq_h + d[:, None] * sq_d, mask=(col < G)[None, :], other=0.0)
    q_t = (q_t.to(tl.float32) * scale).to(tl.float16)
    lo_all = tl.load(summ[:, None] + d[None, :], mask=ok[:, None], other=0.0).to(tl.float16)
    hi_all = tl.load(summ[:, None] + ss_mm + d[None, :], mask=ok[:, None], other=0.0).to(tl.float16)
    base_all = tl.dot(hi_all, q_t, tl.dot(lo_all, q_t)) * 0.5  # [NP, GD]
    base = tl.sum(tl.where(col[None, None, :] == g[None, :, None], base_all[:, None, :], 0.0), axis=2)  # [NP, GP]
    WORDS: tl.constexpr = PAGE // 4
    word = tl.arange(0, WORDS)
    # acc_k[c, j, g]: sum over the picked channels of q * step * f, f = 1 + code / 4 of token 4 j + k.
    acc0 = tl.zeros([NP, WORDS, GP], tl.float32)
    acc1 = tl.zeros([NP, WORDS, GP], tl.float32)
    acc2 = tl.zeros([NP, WORDS, GP], tl.float32)
    acc3 = tl.zeros([NP, WORDS, GP], tl.float32)
    shift = tl.zeros([NP, GP], tl.float32)  # sum over the picked channels of q * step
    pr = slot if PICKS_BY_SLOT else b
    qp_row = qp_ptr + pr * sqp_b + h * sqp_h + g  # a channel's GP heads are contiguous
    # 16-bit summaries: 4 gathers of 2 bytes per code byte took as long as the rest of the refinement.
    HALF: tl.constexpr = summ_ptr.dtype.element_ty.primitive_bitwidth == 16
    for r in tl.static_range(NB):
        best = tl.load(sel_ptr + pr * ssel_b + h * ssel_h + r)
        row = tl.load(words_ptr + page[:, None] * sw_p + h * sw_h + best * sw_j + word[None, :] * sw_w,
                      mask=ok[:, None], other=0)  # [NP, WORDS]
        if HALF:  # the byte's 4 channels' lo and hi in one 8-byte load each
            lo4 = tl.load((summ + PER_BYTE * best).to(tl.pointer_type(tl.int64)), mask=ok, other=0)
            hi4 = tl.load((summ + ss_mm + PER_BYTE * best).to(tl.pointer_type(tl.int64)), mask=ok, other=0)
        for i in tl.static_range(PER_BYTE):
            if HALF:
                lo = _half(lo4, i, summ_ptr.dtype.element_ty)
                hi = _half(hi4, i, summ_ptr.dtype.element_ty)
            else:
                lo = tl.load(summ + PER_BYTE * best + i, mask=ok, other=0.0).to(tl.float32)
                hi = tl.load(summ + ss_mm + PER_BYTE * best + i, mask=ok, other=0.0).to(tl.float32)
            step = (hi - lo) / LEVELS
            wt = step[:, None] * tl.load(qp_row + (PER_BYTE * r + i) * sqp_c)[None, :]  # [NP, GP]: one vector load
            shift += wt
            acc0 += wt[:, None, :] * _code_f(row, 0 + BITS * i, GP, LOG_GP)
            acc1 += wt[:, None, :] * _code_f(row, 8 + BITS * i, GP, LOG_GP)
            acc2 += wt[:, None, :] * _code_f(row, 16 + BITS * i, GP, LOG_GP)
            acc3 += wt[:, None, :] * _code_f(row, 24 + BITS * i, GP, LOG_GP)
    # code - 1.5 = 4 f - 5.5; exp(4 (acc - m)) as one FMA and a base-2 exponential, one reduction over threads each.
    m = tl.max(tl.maximum(tl.maximum(acc0, acc1), tl.maximum(acc2, acc3)), axis=1)  # [NP, GP]
    K: tl.constexpr = 4.0 * 1.4426950408889634
    mk = (m * K)[:, None, :]
    tot = tl.sum(tl.exp2(acc0 * K - mk) + tl.exp2(acc1 * K - mk) + tl.exp2(acc2 * K - mk) + tl.exp2(acc3 * K - mk),
                 axis=1)
    lse = base + 4.0 * m - 5.5 * shift + tl.log(tot)
    lse = tl.where(ok[:, None], lse, float("-inf"))
    tl.store(lse_ptr + b * sl_b + h * sl_h + c[:, None].to(tl.int64) * sl_c + g[None, :], lse,
             mask=(c < C)[:, None] & (g < G)[None, :])


@triton.jit
def _half(x, i: tl.constexpr, dtype: tl.constexpr):
    """fp32 of the 16-bit value (dtype: bf16 or fp16) at bits 16 i of the int64 x (little-endian: element i). A bf16's
    fp32 is its bits in the top half of a word: one shift or mask."""
    if dtype == tl.bfloat16:
        w = x.to(tl.int32) if i < 2 else (x >> 32).to(tl.int32)
        w = w << 16 if i % 2 == 0 else w & -65536
        return w.to(tl.float32, bitcast=True)
    return ((x >> (16 * i)) & 0xFFFF).to(tl.int16).to(dtype, bitcast=True).to(tl.float32)


@triton.jit
def _code_f(row, s: tl.constexpr, GP: tl.constexpr, LOG_GP: tl.constexpr):
    """[NP, WORDS, GP]: 1 + code / 4 for the 2-bit code at bit s of each word (exponent bits of 1.0 with the code in
    the top two mantissa bits: a shift and a mask, no conversion), the same for every query head."""
    if s <= 21:
        x = row << (21 - s)
    else:
        x = row >> (s - 21)
    x = (x & 0x00600000 | 0x3F800000).to(tl.float32, bitcast=True)
    for _ in tl.static_range(LOG_GP):
        x = tl.join(x, x)
    return tl.reshape(x, [x.shape[0], x.shape[1], GP])


@triton.jit
def _rerank_pool_kernel(
    lse_ptr, cand_ptr, cend_ptr, heads_ptr, scores_ptr,
    C, cand_start, M,
    sl_b, sl_h, sl_c,
    scd_b, scd_h, scd_c, s_cend,
    sh_b, sh_h,
    so_b, so_h, so_m,
    G: tl.constexpr, GP: tl.constexpr, BLOCK: tl.constexpr, HEADS: tl.constexpr, WANT: tl.constexpr,
    CAND_LIST: tl.constexpr,
):
    """scores[b, h]: _pool_row, for the heads of the phase."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    if HEADS:  # noqa: SIM102 (a constexpr branch around a runtime one)
        if tl.load(heads_ptr + b * sh_b + h * sh_h).to(tl.int32) != WANT:
            return
    _pool_row(b, h, lse_ptr, cand_ptr, cend_ptr, scores_ptr, C, cand_start, M, sl_b, sl_h, sl_c, scd_b, scd_h, scd_c,
              s_cend, so_b, so_h, so_m, G, GP, BLOCK, CAND_LIST)


@triton.jit
def _pool_row(
    b, h, lse_ptr, cand_ptr, cend_ptr, scores_ptr, C, cand_start, M, sl_b, sl_h, sl_c, scd_b, scd_h, scd_c, s_cend,
    so_b, so_h, so_m, G: tl.constexpr, GP: tl.constexpr, BLOCK: tl.constexpr, CAND_LIST: tl.constexpr,
):
    """scores[b, h]: -inf, then at each candidate page the group mean of its softmax (over candidates) mass."""
    neg_inf = float("-inf")
    row = scores_ptr + b * so_b + h * so_h
    i = tl.arange(0, BLOCK)
    for m0 in range(0, M, BLOCK):
        tl.store(row + (m0 + i).to(tl.int64) * so_m, tl.full([BLOCK], neg_inf, tl.float32), mask=m0 + i < M)
    g = tl.arange(0, GP)
    g_ok = g < G
    # A full scan's candidates stop at the row's end: the log-sum-exps past it are never read (a kernel may skip
    # writing them).
    n = C
    if not CAND_LIST:
        n = tl.minimum(C, tl.minimum(tl.load(cend_ptr + b * s_cend), M) - cand_start)
    m_i = tl.full([GP], neg_inf, tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    for c0 in range(0, C, BLOCK):
        ok = (c0 + i < n)[:, None] & g_ok[None, :]
        x = tl.load(lse_ptr + b * sl_b + h * sl_h + (c0 + i)[:, None] * sl_c + g[None, :], mask=ok, other=neg_inf)
        m_new = tl.maximum(m_i, tl.max(x, axis=0))
        m_safe = tl.where(m_new == neg_inf, 0.0, m_new)
        l_i = l_i * tl.exp(m_i - m_safe) + tl.sum(tl.exp(x - m_safe[None, :]), axis=0)
        m_i = m_new
    m_safe = tl.where(m_i == neg_inf, 0.0, m_i)
    inv_l = 1.0 / tl.maximum(l_i, 1.0)  # >= 1 where the head has a candidate
    tl.debug_barrier()  # the -inf fill above lands before the candidates' scores
    for c0 in range(0, C, BLOCK):
        ok = (c0 + i < n)[:, None] & g_ok[None, :]
        x = tl.load(lse_ptr + b * sl_b + h * sl_h + (c0 + i)[:, None] * sl_c + g[None, :], mask=ok, other=neg_inf)
        pooled = tl.sum(tl.exp(x - m_safe[None, :]) * inv_l[None, :], axis=1) / G
        if CAND_LIST:
            logical = tl.load(cand_ptr + b * scd_b + h * scd_h + (c0 + i) * scd_c, mask=c0 + i < C, other=-1)
        else:
            logical = tl.where(c0 + i < n, cand_start + c0 + i, -1)
        tl.store(row + logical.to(tl.int64) * so_m, pooled, mask=logical >= 0)


RERANK_ROWS = 64  # tokens per program of the log-sum-exp kernel: 64 / p candidate pages
RERANK_WARPS = 2
POOL_BLOCK = 1024  # pages per step of the pooling loops: 128 took 9.1 us per call at 16 x 32K (H100), 1024 3.7
POOL_WARPS = 8


def rerank_pages(
    q: torch.Tensor,
    summaries: torch.Tensor,
    codes: torch.Tensor,
    page_table: torch.Tensor,
    req_slots: torch.Tensor,
    cand: torch.Tensor | None,
    scale: float,
    heads: torch.Tensor | None = None,
    phase: int = 1,
    q_by_slot: bool = False,
    cand_start: int = 0,
    cand_end: torch.Tensor | None = None,
) -> torch.Tensor:
    """See naive_rerank_pages."""
    B, G, D, H, M, p = _page_inputs(q, summaries, codes, page_table, req_slots, q_by_slot)
    assert p >= 16 and p & (p - 1) == 0, "tl.dot needs pages of at least 16 tokens"
    if cand is None:
        C, cand_args = _full_scan(req_slots, cand_start, cand_end, M)
    else:
        check_device(cand)
        assert cand.shape[:2] == (B, H) and cand.dtype == torch.int32
        C, cand_args = cand.shape[2], (cand, req_slots, cand.stride(), 0)
    heads_args = _heads_args(heads, phase, req_slots)
    heads_arg, heads_strides, with_heads, want = heads_args
    scores = empty(B, H, M, dtype=torch.float32, device=q.device)
    if B * H == 0:
        return scores
    gp = triton.next_power_of_2(G)
    lse = empty(B, H, max(C, 1), gp, dtype=torch.float32, device=q.device)  # scratch
    cand_ptr, cend_ptr, cand_strides, cend_stride = cand_args
    if C:
        block_c = max(1, RERANK_ROWS // p)
        _rerank_lse_kernel[(B, H, triton.cdiv(C, block_c))](
            q, summaries, codes, page_table, req_slots, cand_ptr, cend_ptr, heads_arg, lse,
            C, cand_start, M, scale,
            *q.stride(), summaries.stride(0), summaries.stride(1), summaries.stride(2),
            *codes.stride(),
            *page_table.stride(), req_slots.stride(0), cend_stride, *cand_strides, *heads_strides, *lse.stride()[:3],
            G=G, GP=max(16, gp), D=D, PAGE=p, BLOCK_C=block_c, HEADS=with_heads, WANT=want,
            Q_BY_SLOT=q_by_slot, CAND_LIST=cand is not None, LEVELS=LEVELS, BITS=CODE_BITS, PER_BYTE=PER_BYTE,
            KP=max(16, D // PER_BYTE),
            num_warps=RERANK_WARPS,
        )
    _pool(lse, cand_args, cand is not None, heads_args, scores, C, cand_start, G)
    return scores


def _page_inputs(q, summaries, codes, page_table, req_slots, q_by_slot) -> tuple:
    """The checked shapes (B, G, D, H, M, p) of the inputs rerank_pages and sketch_pages share."""
    check_device(q, summaries, codes, page_table, req_slots)
    check_index_vectors(req_slots=req_slots)
    B, Hq, D = req_slots.shape[0], q.shape[1], q.shape[2]
    H, M, p = summaries.shape[1], page_table.shape[1], codes.shape[2]
    assert Hq % H == 0 and summaries.shape[2:] == (2, D) and summaries.stride(-1) == 1
    assert codes.shape[1] == H and codes.shape[3] * PER_BYTE == D and codes.dtype == torch.uint8
    assert q_by_slot or q.shape[0] == B
    return B, Hq // H, D, H, M, p


def _full_scan(req_slots, cand_start, cand_end, M) -> tuple:
    """(C, candidate arguments) of every page in [cand_start, cand_end[b]): the kernels' CAND_LIST=False path."""
    assert cand_end is not None
    check_device(cand_end)
    check_index_vectors(cand_end=cand_end)
    return max(M - cand_start, 0), (req_slots, cand_end, (0, 0, 0), cand_end.stride(0))


def _pool(lse, cand_args, cand_list, heads_args, scores, C, cand_start, G) -> None:
    """scores from the per-candidate log-sum-exps (_rerank_pool_kernel)."""
    cand_ptr, cend_ptr, cand_strides, cend_stride = cand_args
    heads_arg, heads_strides, with_heads, want = heads_args
    B, H, M = scores.shape
    _rerank_pool_kernel[(B, H)](
        lse, cand_ptr, cend_ptr, heads_arg, scores, C, cand_start, M, *lse.stride()[:3], *cand_strides, cend_stride,
        *heads_strides, *scores.stride(),
        G=G, GP=lse.shape[3], BLOCK=POOL_BLOCK, HEADS=with_heads, WANT=want, CAND_LIST=cand_list,
        num_warps=POOL_WARPS,
    )


# Tokens per program of the sketch kernel: max(16, 512 / p) pages, p / 16 threads each. Measured on an H100 at
# 16 x 32K, p 32: 512 / 4 warps 94 us, 1024 / 4 107, 2048 / 4 131, 512 / 1 120; with 4 warps a 16-page program holds
# each page in every warp (the layout's tile is 64 pages) and still runs fastest: the kernel waits on memory
# latency, not on issue (232 SASS instructions per page and warp, the earlier kernel's 540, took as long).
SKETCH_TOKENS = 512
SKETCH_WARPS = 4


def sketch_pages(
    q: torch.Tensor,
    summaries: torch.Tensor,
    codes: torch.Tensor,
    page_table: torch.Tensor,
    req_slots: torch.Tensor,
    scale: float,
    nbytes: int,
    heads: torch.Tensor | None = None,
    phase: int = 1,
    q_by_slot: bool = False,
    cand_start: int = 0,
    cand_end: torch.Tensor | None = None,
    picks: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """See naive_sketch_pages."""
    B, G, D, H, M, p = _page_inputs(q, summaries, codes, page_table, req_slots, q_by_slot)
    assert 0 < nbytes <= D // PER_BYTE and p & (p - 1) == 0 and p >= 4
    assert codes.stride(2) == 1, "the sketch reads code rows as words: a byte-major store (empty_codes)"
    C, cand_args = _full_scan(req_slots, cand_start, cand_end, M)
    heads_args = _heads_args(heads, phase, req_slots)
    heads_arg, heads_strides, with_heads, want = heads_args
    scores = empty(B, H, M, dtype=torch.float32, device=q.device)
    if B * H == 0:
        return scores
    gp = triton.next_power_of_2(G)
    lse = empty(B, H, max(C, 1), gp, dtype=torch.float32, device=q.device)  # scratch
    if C:
        if picks is None:
            sel = empty(B, H, nbytes, dtype=torch.int32, device=q.device)  # scratch
            qp = empty(B, H, nbytes * PER_BYTE, gp, dtype=torch.float32, device=q.device)  # scratch
            _sketch_picks_kernel[(B, H)](
                q, req_slots, heads_arg, sel, qp, scale, *q.stride(), req_slots.stride(0), *heads_strides,
                *sel.stride()[:2], *qp.stride()[:3],
                G=G, GP=gp, KB=D // PER_BYTE, NB=nbytes, HEADS=with_heads, WANT=want, Q_BY_SLOT=q_by_slot,
                PER_BYTE=PER_BYTE, num_warps=1,
            )
        else:
            sel, qp = picks
            check_device(sel, qp)
            assert sel.dim() == 3 and sel.shape[1:] == (H, nbytes) and sel.dtype == torch.int32
            assert qp.shape[1:] == (H, nbytes * PER_BYTE, gp) and qp.dtype == torch.float32 and qp.stride(3) == 1
        np_ = max(16, SKETCH_TOKENS // p)  # >= 16 pages for the mid-range product
        words = codes.transpose(2, 3).view(torch.int32)  # [P, H, D / 4, p / 4]: 4 tokens' byte per word
        _sketch_lse_kernel[(B, H, triton.cdiv(C, np_))](
            q, summaries, words, page_table, req_slots, cand_end, heads_arg, sel, qp, lse,
            C, cand_start, M, scale,
            *q.stride(), summaries.stride(0), summaries.stride(1), summaries.stride(2), *words.stride(),
            *page_table.stride(), req_slots.stride(0), cand_end.stride(0), *heads_strides, *sel.stride()[:2],
            *qp.stride()[:3], *lse.stride()[:3],
            G=G, GP=gp, LOG_GP=gp.bit_length() - 1, GD=max(16, gp), D=D, NB=nbytes, PAGE=p, NP=np_,
            HEADS=with_heads, WANT=want, Q_BY_SLOT=q_by_slot, LEVELS=LEVELS, BITS=CODE_BITS, PER_BYTE=PER_BYTE,
            PICKS_BY_SLOT=picks is not None, num_warps=SKETCH_WARPS,
        )
    _pool(lse, cand_args, False, heads_args, scores, C, cand_start, G)
    return scores
