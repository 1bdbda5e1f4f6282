"""Split-K ("flash-decoding") Triton kernels for sparse_decode_attention (see docs/kernels.md).

Pass 1, grid (B, H, NUM_SPLITS): each program takes all G query heads of one KV head over a contiguous range
of the row's pages and writes a partial (max, sum, weighted V) in fp32. Pass 2, grid (B, Hq): combines the
splits. Splitting the pages keeps an H100 busy at batch 1 with few KV heads; NUM_SPLITS depends only on
shapes, so both grids are fixed and the op can be captured in a CUDA graph.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .._alloc import empty
from .._utils import check_device, check_index_vectors

_LOG2E = 1.4426950408889634
# tl.dot needs every dimension >= 16 on GPU: query heads and page tokens are padded (masked) up to this.
_MIN_DOT = 16
# Reduce-kernel tile is [NUM_SPLITS, D]; more splits than this buy nothing at decode sizes.
_MAX_SPLITS = 64
# Interpreter (CPU) runs program by program: a few programs are enough and keep tests fast.
_CPU_PROGRAMS = 16


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _num_splits(batch: int, heads: int, width: int, device: torch.device) -> int:
    """Splits per row so that pass 1 runs about two programs per SM (shapes only, never data)."""
    target = 2 * _sm_count(device.index) if device.type == "cuda" else _CPU_PROGRAMS
    splits = max(1, min(width, _MAX_SPLITS, triton.cdiv(target, batch * heads)))
    # Same pages per split, fewer splits: a row using all W pages then has no empty split.
    return max(1, triton.cdiv(width, max(1, triton.cdiv(width, splits))))


@triton.jit
def _sparse_decode_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    page_table_ptr,
    num_pages_ptr,
    last_page_len_ptr,
    part_m_ptr,
    part_l_ptr,
    part_o_ptr,
    qk_scale,
    pages_per_split,
    stride_qb,
    stride_qh,
    stride_qd,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_pb,
    stride_pw,
    G: tl.constexpr,
    G_PAD: tl.constexpr,
    D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    PAGE_TILE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    num_q_heads = tl.num_programs(1) * G

    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D)
    t = tl.arange(0, PAGE_TILE)
    g_mask = g < G
    hq = h * G + g

    # Scale folded into q once; scores live in the log2 domain (exp2 below).
    q = tl.load(
        q_ptr + b * stride_qb + hq[:, None] * stride_qh + d[None, :] * stride_qd, mask=g_mask[:, None], other=0.0
    )
    q = q.to(tl.float32) * qk_scale

    n_pages = tl.load(num_pages_ptr + b)
    last_len = tl.load(last_page_len_ptr + b)
    start = split * pages_per_split
    end = tl.minimum(start + pages_per_split, n_pages)

    # An empty range (short row) leaves the neutral partial: max -inf, sum 0, acc 0.
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D], tl.float32)
    for i in range(start, end):
        page = tl.load(page_table_ptr + b * stride_pb + i * stride_pw).to(tl.int64)
        t_mask = t < tl.where(i == n_pages - 1, last_len, PAGE_SIZE)
        rows = page * PAGE_SIZE + t
        # Masked rows load 0 (never stale data, which may be NaN), so their 0 weight times V stays 0.
        k_ptrs = k_ptr + rows[:, None] * stride_kt + h * stride_kh + d[None, :] * stride_kd
        v_ptrs = v_ptr + rows[:, None] * stride_vt + h * stride_vh + d[None, :] * stride_vd
        k = tl.load(k_ptrs, mask=t_mask[:, None], other=0.0)
        v = tl.load(v_ptrs, mask=t_mask[:, None], other=0.0)
        # fp32 "ieee" dots: exact enough for fp32 inputs (tf32 is not), and the interpreter mis-multiplies bf16.
        s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        s = tl.where(t_mask[None, :], s, float("-inf"))
        # Every page holds >= 1 token, so m_new is finite from the first page on.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        m_i = m_new

    part = (b * num_q_heads + hq) * NUM_SPLITS + split
    tl.store(part_m_ptr + part, m_i, mask=g_mask)
    tl.store(part_l_ptr + part, l_i, mask=g_mask)
    tl.store(part_o_ptr + part[:, None] * D + d[None, :], acc, mask=g_mask[:, None])


@triton.jit
def _combine_splits_kernel(
    part_m_ptr,
    part_l_ptr,
    part_o_ptr,
    o_ptr,
    stride_ob,
    stride_oh,
    stride_od,
    D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    hq = tl.program_id(1).to(tl.int64)
    sp = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, D)
    sp_mask = sp < NUM_SPLITS
    part = (b * tl.num_programs(1) + hq) * NUM_SPLITS + sp

    m = tl.load(part_m_ptr + part, mask=sp_mask, other=float("-inf"))
    l = tl.load(part_l_ptr + part, mask=sp_mask, other=0.0)
    acc = tl.load(part_o_ptr + part[:, None] * D + d[None, :], mask=sp_mask[:, None], other=0.0)

    m_max = tl.max(m, 0)
    # A row without pages has only neutral partials: weights 0, acc 0, so it outputs 0 (not 0/0).
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_max)
    l_sum = tl.sum(w * l, 0)
    out = tl.sum(w[:, None] * acc, 0) / tl.where(l_sum > 0, l_sum, 1.0)
    tl.store(o_ptr + b * stride_ob + hq * stride_oh + d * stride_od, out.to(o_ptr.dtype.element_ty))


def sparse_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    num_pages: torch.Tensor,
    last_page_len: torch.Tensor,
    scale: float,
    page_size: int,
) -> torch.Tensor:
    check_device(q, k_cache, v_cache, page_table, num_pages, last_page_len)
    check_index_vectors(num_pages=num_pages, last_page_len=last_page_len)
    batch, num_q_heads, head_dim = q.shape
    heads = k_cache.shape[1]
    if num_q_heads % heads:
        raise ValueError(f"{num_q_heads} query heads are not a multiple of {heads} KV heads")
    group = num_q_heads // heads
    width = page_table.shape[1]
    splits = _num_splits(batch, heads, width, q.device)

    o = empty(batch, num_q_heads, head_dim, dtype=q.dtype, device=q.device)
    part_m = empty(batch, num_q_heads, splits, dtype=torch.float32, device=q.device)
    part_l = empty(batch, num_q_heads, splits, dtype=torch.float32, device=q.device)
    part_o = empty(batch, num_q_heads, splits, head_dim, dtype=torch.float32, device=q.device)

    _sparse_decode_attention_kernel[(batch, heads, splits)](
        q,
        k_cache,
        v_cache,
        page_table,
        num_pages,
        last_page_len,
        part_m,
        part_l,
        part_o,
        scale * _LOG2E,
        triton.cdiv(width, splits),
        *q.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        *page_table.stride(),
        G=group,
        G_PAD=max(_MIN_DOT, triton.next_power_of_2(group)),
        D=head_dim,
        PAGE_SIZE=page_size,
        PAGE_TILE=max(_MIN_DOT, page_size),
        NUM_SPLITS=splits,
    )
    _combine_splits_kernel[(batch, num_q_heads)](
        part_m,
        part_l,
        part_o,
        o,
        *o.stride(),
        D=head_dim,
        NUM_SPLITS=splits,
        SPLITS_PAD=triton.next_power_of_2(splits),
    )
    return o
