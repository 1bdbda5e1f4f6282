"""Triton kernel of the channel sketch: per (row, KV head, block of pages) the tensor-core product of the pages'
4-bit codes [tokens, R] with the weights scale * q * step [R, G] shared by every page (four products, one per code of
a 16-bit word), then each page's log-sum-exp over its tokens; page_rerank's pooling kernel turns those into the
scores select_slots takes."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._alloc import empty
from .._utils import check_device, check_index_vectors
from ..page_rerank.triton import _full_scan, _pool
from ..page_select.triton import _heads_args
from .naive import BITS, LN2, LOG2E

_LN2 = tl.constexpr(LN2)  # globals a jitted function reads must be constexpr
_LOG2E = tl.constexpr(LOG2E)


@triton.jit(do_not_specialize=["n_items"])
def _channel_lse_kernel(
    q_ptr, codes_ptr, ch_ptr, step_ptr, pt_ptr, slots_ptr, cend_ptr, heads_ptr, lse_ptr,
    cand_start, M, scale, n_heads, n_chunks, n_items,
    sq_b, sq_h, sq_d,
    sc_p, sc_h,
    sch_h, sstep_h,
    spt_r, spt_m, s_slot, s_cend,
    sh_b, sh_h,
    sl_b, sl_h, sl_c,
    G: tl.constexpr, GP: tl.constexpr, TPR: tl.constexpr, HALF: tl.constexpr, PAGE: tl.constexpr,
    NP: tl.constexpr, BLOCKS: tl.constexpr, STAGES: tl.constexpr, HEADS: tl.constexpr, WANT: tl.constexpr,
    Q_BY_SLOT: tl.constexpr, BITS: tl.constexpr, STRIDED: tl.constexpr,
):
    """lse[b, h, c, g] of BLOCKS blocks of NP pages per item (row b, KV head h, chunk of pages), up to the row's
    candidate end (the pool reads no further). Not STRIDED: a program per item, grid (B, H, chunks). STRIDED: a 1-D grid
    of programs strides over the items (row-major, chunk fastest), so the launch never queues more programs than it
    runs at once: a kernel beside the model's GEMMs (the speculative scoring) then leaves them SMs."""
    if not STRIDED:
        _channel_lse_item(
            tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64), tl.program_id(2),
            q_ptr, codes_ptr, ch_ptr, step_ptr, pt_ptr, slots_ptr, cend_ptr, heads_ptr, lse_ptr, cand_start, M, scale,
            sq_b, sq_h, sq_d, sc_p, sc_h, sch_h, sstep_h, spt_r, spt_m, s_slot, s_cend, sh_b, sh_h, sl_b, sl_h, sl_c,
            G, GP, TPR, HALF, PAGE, NP, BLOCKS, STAGES, HEADS, WANT, Q_BY_SLOT, BITS)
    else:
        for item in range(tl.program_id(0), n_items, tl.num_programs(0)):
            bh = item // n_chunks
            _channel_lse_item(
                (bh // n_heads).to(tl.int64), (bh % n_heads).to(tl.int64), item % n_chunks,
                q_ptr, codes_ptr, ch_ptr, step_ptr, pt_ptr, slots_ptr, cend_ptr, heads_ptr, lse_ptr, cand_start, M,
                scale, sq_b, sq_h, sq_d, sc_p, sc_h, sch_h, sstep_h, spt_r, spt_m, s_slot, s_cend, sh_b, sh_h, sl_b,
                sl_h, sl_c, G, GP, TPR, HALF, PAGE, NP, BLOCKS, STAGES, HEADS, WANT, Q_BY_SLOT, BITS)


@triton.jit
def _channel_lse_item(
    b, h, chunk,
    q_ptr, codes_ptr, ch_ptr, step_ptr, pt_ptr, slots_ptr, cend_ptr, heads_ptr, lse_ptr,
    cand_start, M, scale,
    sq_b, sq_h, sq_d, sc_p, sc_h, sch_h, sstep_h, spt_r, spt_m, s_slot, s_cend, sh_b, sh_h, sl_b, sl_h, sl_c,
    G: tl.constexpr, GP: tl.constexpr, TPR: tl.constexpr, HALF: tl.constexpr, PAGE: tl.constexpr,
    NP: tl.constexpr, BLOCKS: tl.constexpr, STAGES: tl.constexpr, HEADS: tl.constexpr, WANT: tl.constexpr,
    Q_BY_SLOT: tl.constexpr, BITS: tl.constexpr,
):
    """One item of _channel_lse_kernel. A product row holds TPR consecutive tokens (TPR * HALF code bytes,
    contiguous) and the weights are block-diagonal [TPR * HALF, TPR * GP], so the product's TPR * GP >= 16 columns
    are TPR tokens x GP query heads: every column is a logit the log-sum-exp needs. (With the GP columns alone, padded
    to 16 for the product, three quarters of a 4-head group's exponentials were padding, and they took most of the
    time.) The weights are made once per item and the blocks' loads pipelined. An item of a head outside the phase,
    or past the row's candidates, writes nothing (a guard, not a return: the strided loop goes on)."""
    end = tl.minimum(tl.load(cend_ptr + b * s_cend), M)
    first = chunk * BLOCKS * NP
    run = cand_start + first < end
    if HEADS:
        run = run & (tl.load(heads_ptr + b * sh_b + h * sh_h).to(tl.int32) == WANT)
    if run:
        slot = tl.load(slots_ptr + b * s_slot).to(tl.int64)
        q_row = q_ptr + (slot if Q_BY_SLOT else b) * sq_b + h * G * sq_h
        ch_row, step_row = ch_ptr + h * sch_h, step_ptr + h * sstep_h
        w0 = _weights(q_row, ch_row, step_row, scale, sq_h, sq_d, 0, G, GP, TPR, HALF)
        w1 = _weights(q_row, ch_row, step_row, scale, sq_h, sq_d, 1, G, GP, TPR, HALF)
        w2 = _weights(q_row, ch_row, step_row, scale, sq_h, sq_d, 2, G, GP, TPR, HALF)
        w3 = _weights(q_row, ch_row, step_row, scale, sq_h, sq_d, 3, G, GP, TPR, HALF)
        ROWS: tl.constexpr = PAGE // TPR  # product rows per page
        WORDS: tl.constexpr = TPR * HALF // 2  # 16-bit words of codes per product row
        r = tl.arange(0, ROWS)
        k = tl.arange(0, WORDS)
        g = tl.arange(0, GP)
        # The codes as 16-bit words of four codes each (bytes widened to 16 bits took byte permutes: SASS counts with
        # the exp2 and _log2_sum in docs/results/session45), turned into fp16 without a conversion: a code masked into
        # an fp16's mantissa under a fixed exponent, less that exponent's value (exact). Codes 0 and 2 of a word (bits
        # 0-3 and, after one shift by 8, 8-11) sit at the mantissa's unit under 1024's exponent (1024 + code); codes
        # 1 and 3 (bits 4-7) sit there under 64's (64 + code: mantissa bits 4-7 weigh 1 at exponent 6), so the word
        # takes one shift, not three.
        tl.static_assert(4 * BITS == 16)
        LOW: tl.constexpr = (1 << BITS) - 1
        HIGH: tl.constexpr = LOW << BITS
        words_ptr = codes_ptr.to(tl.pointer_type(tl.uint16))
        k1024 = tl.full([1, 1], 1024.0, tl.float16)
        k64 = tl.full([1, 1], 64.0, tl.float16)
        for blk in tl.range(0, BLOCKS, num_stages=STAGES):
            c = first + blk * NP + tl.arange(0, NP)
            ok = cand_start + c < end
            page = tl.load(pt_ptr + slot * spt_r + (cand_start + c).to(tl.int64) * spt_m, mask=ok, other=0)
            page = page.to(tl.int64)
            word = tl.load(words_ptr + page[:, None, None] * (sc_p // 2) + h * (sc_h // 2)
                           + (r * WORDS)[None, :, None] + k[None, None, :], mask=ok[:, None, None], other=0)
            word = tl.reshape(word, [NP * ROWS, WORDS])
            acc = tl.dot(((word & LOW) | 0x6400).to(tl.float16, bitcast=True) - k1024, w0)
            acc = tl.dot(((word & HIGH) | 0x5400).to(tl.float16, bitcast=True) - k64, w1, acc)
            word = word >> 2 * BITS
            acc = tl.dot(((word & LOW) | 0x6400).to(tl.float16, bitcast=True) - k1024, w2, acc)
            acc = tl.dot(((word & HIGH) | 0x5400).to(tl.float16, bitcast=True) - k64, w3, acc)
            acc = tl.reshape(acc, [NP, PAGE, GP])  # column t * GP + g of row i: token TPR * i + t, head g
            m = tl.max(acc, axis=1)  # [NP, GP]
            # acc holds the logits in log2 units (the weights carry log2(e)): exp2 needs no multiply per logit.
            lse = (m + _log2_sum(tl.sum(tl.exp2(acc - m[:, None, :]), axis=1))) * _LN2
            tl.store(lse_ptr + b * sl_b + h * sl_h + c[:, None].to(tl.int64) * sl_c + g[None, :], lse,
                     mask=ok[:, None] & (g < G)[None, :])


@triton.jit
def _log2_sum(x):
    """log2 of a sum of exponentials whose largest is 1 (x in [1, PAGE]): its exponent plus a degree-7 polynomial of
    its mantissa (|error| < 4e-7, then fp32's rounding of the sum; coefficients fitted on Chebyshev nodes of [1, 2)).
    tl.log2 is libm's (range checks and a longer polynomial, ~25 instructions), and each thread takes 8 a block: its
    reduced values are replicated across the lanes that reduced them. NaN stays NaN."""
    bits = x.to(tl.int32, bitcast=True)
    t = ((bits & 0x7FFFFF) | 0x3F800000).to(tl.float32, bitcast=True) - 1.0  # the mantissa, less 1: [0, 1)
    p = 0.014778893440961838 * t - 0.07684961706399918
    p = p * t + 0.19042252004146576
    p = p * t - 0.3231174945831299
    p = p * t + 0.4725002944469452
    p = p * t - 0.720386803150177
    p = p * t + 1.4426521062850952
    p = p * t + 3.1912864528749196e-07
    return tl.where(x == x, ((bits >> 23) - 127).to(tl.float32) + p, x)


@triton.jit
def _weights(q_row, ch_ptr, step_ptr, scale, sq_h, sq_d, NIBBLE: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
             TPR: tl.constexpr, HALF: tl.constexpr):
    """[TPR * HALF / 2, TPR * GP] fp16 weights of nibble NIBBLE of a product row's 16-bit code words: word i holds
    bytes 2i (bits 0-7) and 2i + 1, byte b token b // HALF's code of channel b % HALF (low nibble) and b % HALF + HALF
    (high nibble). Block-diagonal: each row holds scale * q * step of the group's query heads (columns of its token)
    on its channel; 0 elsewhere and in the padding heads' columns."""
    k = tl.arange(0, TPR * HALF // 2)
    n = tl.arange(0, TPR * GP)
    b = 2 * k + NIBBLE // 2
    c = b % HALF + (NIBBLE % 2) * HALF
    ch = tl.load(ch_ptr + c).to(tl.int64)
    step = tl.load(step_ptr + c)
    on = ((b // HALF)[:, None] == (n // GP)[None, :]) & (n % GP < G)[None, :]
    qv = tl.load(q_row + (n % GP)[None, :] * sq_h + ch[:, None] * sq_d, mask=on, other=0.0)
    return (qv.to(tl.float32) * (scale * _LOG2E) * step[:, None]).to(tl.float16)


# Tokens per block (512 / p pages) and warps. Measured on an H100 at 16 x 32K, p 32, G 4 (score alone, µs), 32 / 64
# channels: 256 tokens / 4 warps 81 / 123, 512 / 4 71 / 108, 1024 / 4 69 / 126, 1024 / 8 73 / 117, 2048 / 4 87 / 147;
# 2 warps differ little at 256-512 tokens and collapse at 2048. Blocks per program (session 25, H100, score and pool,
# 32 channels): 1 block 64.9 µs at 16 x 32K, 8.6 at 1 x 32K, 68.7 at 4 x 128K; 2 blocks, 2 stages 60.3 / 8.8 / 65.3;
# 8 blocks, 3 stages 59.7 / 15.7 / 65.3 (too few programs at one request).
CHANNEL_TOKENS = 512
CHANNEL_WARPS = 4
CHANNEL_BLOCKS = 2
CHANNEL_STAGES = 2


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
    programs: int = 0,
    pool: bool = True,
) -> torch.Tensor:
    """See naive_channel_sketch_pages. programs > 0: that many GPU programs stride over the (row, head, chunk of
    pages) items instead of one program per item. pool False: the log-sum-exps (written up to each row's candidate
    end) without the pooling launch, for select_chain."""
    check_device(q, codes, channels, step, page_table, req_slots)
    check_index_vectors(req_slots=req_slots)
    B, Hq, D = req_slots.shape[0], q.shape[1], q.shape[2]
    P, H, p, half = codes.shape
    R, M = 2 * half, page_table.shape[1]
    assert Hq % H == 0 and codes.dtype == torch.uint8 and codes.stride(3) == 1 and codes.stride(2) == half, \
        "a page of a head's codes must be contiguous (token-major)"
    assert codes.stride(0) % 2 == codes.stride(1) % 2 == codes.data_ptr() % 2 == 0, "codes are read as 16-bit words"
    assert channels.shape == (H, R) and channels.dtype == torch.int32 and channels.stride(1) == 1
    assert step.shape == (H, R) and step.dtype == torch.float32 and step.stride(1) == 1
    assert R % 32 == 0 and R <= D and p >= 16 and p & (p - 1) == 0, "tl.dot needs 16 x 16 operands"
    G, gp = Hq // H, triton.next_power_of_2(Hq // H)
    tpr = max(1, 16 // gp)  # tokens per product row: TPR * GP >= 16 columns
    assert q_by_slot or q.shape[0] == B
    C, cand_args = _full_scan(req_slots, cand_start, cand_end, M)
    heads_args = _heads_args(heads, phase, req_slots)
    heads_arg, heads_strides, with_heads, want = heads_args
    lse = empty(B, H, max(C, 1), gp, dtype=torch.float32, device=q.device)  # scratch when pooled here
    scores = empty(B, H, M, dtype=torch.float32, device=q.device) if pool else lse
    if B * H == 0:
        return scores
    if C:
        np_ = max(1, CHANNEL_TOKENS // p)
        chunks = triton.cdiv(C, np_ * CHANNEL_BLOCKS)
        items = B * H * chunks
        grid = (min(programs, items),) if programs else (B, H, chunks)
        _channel_lse_kernel[grid](
            q, codes, channels, step, page_table, req_slots, cand_end, heads_arg, lse,
            cand_start, M, scale, H, chunks, items,
            *q.stride(), codes.stride(0), codes.stride(1), channels.stride(0), step.stride(0),
            *page_table.stride(), req_slots.stride(0), cand_end.stride(0), *heads_strides, *lse.stride()[:3],
            G=G, GP=gp, TPR=tpr, HALF=half, PAGE=p, NP=np_, BLOCKS=CHANNEL_BLOCKS, STAGES=CHANNEL_STAGES,
            HEADS=with_heads, WANT=want, Q_BY_SLOT=q_by_slot, BITS=BITS, STRIDED=bool(programs),
            num_warps=CHANNEL_WARPS,
        )
    if pool:
        _pool(lse, cand_args, False, heads_args, scores, C, cand_start, G)
    return scores
