"""Triton tsp_select: the TSP layer's token scores in two passes over key tiles, then pool and pick in torch.

Pass 1 (one program per (key tile, KV head)) computes, for the G x W (query head in group, window query) rows of
the KV head, the tile's logit max and exp-sum; torch folds them into each row's log-sum-exp. Pass 2 (one program
per key tile before the window) recomputes the logits of every KV head's rows, normalises them with the row's
log-sum-exp and sums over rows and heads: the softmax is exact and no [W, n] matrix exists beyond one
[G*W, BLOCK_N] tile in registers. Extra memory: 2 x H x ceil(n / BLOCK_N) x G*W fp32 partials (2 MiB at
H=8, G=4, W=8, n=128K) and n fp32 scores. Each key tile is read once per pass and KV head, for all G query heads
of its group (GQA-aware). The tile sums are plain stores, no atomics: the scores are deterministic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._alloc import empty
from .._utils import check_device, interpret_mode
from .naive import POOL, check_args, pick_tokens

BLOCK_N = 128


@triton.jit
def _rows(h, W, G, RP: tl.constexpr):
    r = tl.arange(0, RP)
    return r, h * G + r // W, r % W, r < G * W


@triton.jit
def _logits(q_ptr, k_ptr, h, j, n_keys, W, G, scale, sq_w, sq_h, sk_n, sk_h,
            D: tl.constexpr, RP: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """[RP, BLOCK] logits of the KV head's G*W window rows against keys j (masked: j >= n_keys)."""
    r, hq, w, row_ok = _rows(h, W, G, RP)
    d = tl.arange(0, D)
    q = tl.load(q_ptr + w.to(tl.int64)[:, None] * sq_w + hq.to(tl.int64)[:, None] * sq_h + d[None, :],
                mask=row_ok[:, None], other=0.0)
    kt = tl.load(k_ptr + j.to(tl.int64)[None, :] * sk_n + h * sk_h + d[:, None], mask=(j < n_keys)[None, :],
                 other=0.0)
    if UPCAST:  # the interpreter multiplies bf16 operands as integers
        s = tl.dot(q.to(tl.float32), kt.to(tl.float32), input_precision="ieee")
    else:
        s = tl.dot(q, kt, input_precision=PRECISION)
    return s * scale, w, row_ok


@triton.jit(do_not_specialize=["n", "W", "T"])
def _tsp_stats_kernel(q_ptr, k_ptr, mx_ptr, sm_ptr, n, W, G, T, scale, sq_w, sq_h, sk_n, sk_h,
                      D: tl.constexpr, RP: tl.constexpr, BLOCK: tl.constexpr, PRECISION: tl.constexpr,
                      UPCAST: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    j = t * BLOCK + tl.arange(0, BLOCK)
    s, w, row_ok = _logits(q_ptr, k_ptr, h, j, n, W, G, scale, sq_w, sq_h, sk_n, sk_h, D, RP, PRECISION, UPCAST)
    # Window query w sits at position n - W + w and sees keys up to it.
    vis = row_ok[:, None] & (j[None, :] < n) & (j[None, :] <= (n - W + w)[:, None])
    s = tl.where(vis, s, float("-inf"))
    m = tl.max(s, axis=1)  # -inf for a row that sees none of the tile
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    l = tl.sum(tl.where(vis, tl.exp(s - m_safe[:, None]), 0.0), axis=1)
    r = tl.arange(0, RP)
    out = (h * T + t) * (G * W) + r
    tl.store(mx_ptr + out, m, mask=row_ok)
    tl.store(sm_ptr + out, l, mask=row_ok)


@triton.jit(do_not_specialize=["P", "W"])
def _tsp_scores_kernel(q_ptr, k_ptr, lse_ptr, scores_ptr, P, H, W, G, scale, inv_hq, sq_w, sq_h, sk_n, sk_h,
                       D: tl.constexpr, RP: tl.constexpr, BLOCK: tl.constexpr, PRECISION: tl.constexpr,
                       UPCAST: tl.constexpr):
    """Keys before the window (j < P) are visible to every window query: no causal mask here."""
    j = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32)
    r = tl.arange(0, RP)
    for h in range(H):  # h * sk_h and the lse offsets are small: int32 suffices
        s, w, row_ok = _logits(q_ptr, k_ptr, h, j, P, W, G, scale, sq_w, sq_h, sk_n, sk_h, D, RP, PRECISION,
                               UPCAST)
        lse = tl.load(lse_ptr + h * (G * W) + r, mask=row_ok, other=0.0)
        p = tl.where(row_ok[:, None] & (j < P)[None, :], tl.exp(s - lse[:, None]), 0.0)
        acc += tl.sum(p, axis=0)
    tl.store(scores_ptr + j, acc * inv_hq, mask=j < P)


def tsp_scores(q_win: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """Triton naive_tsp_scores: [n - W] fp32."""
    check_device(q_win, k)
    W, Hq, D = q_win.shape
    n, H, _ = k.shape
    G = Hq // H
    assert D & (D - 1) == 0 and D >= 16 and q_win.stride(2) == 1 and k.stride(2) == 1 and q_win.dtype == k.dtype
    RP = max(16, triton.next_power_of_2(G * W))
    T = triton.cdiv(n, BLOCK_N)
    kw = dict(D=D, RP=RP, BLOCK=BLOCK_N, PRECISION="ieee" if k.dtype == torch.float32 else "tf32",
              UPCAST=interpret_mode() and k.dtype != torch.float32, num_warps=8 if RP * D >= 8192 else 4)
    strides = (q_win.stride(0), q_win.stride(1), k.stride(0), k.stride(1))
    mx = empty(H, T, G * W, dtype=torch.float32, device=k.device)
    sm = empty(H, T, G * W, dtype=torch.float32, device=k.device)
    _tsp_stats_kernel[(T, H)](q_win, k, mx, sm, n, W, G, T, float(scale), *strides, **kw)
    top = mx.amax(1, keepdim=True)  # finite: key 0 is visible to every row
    lse = (top[:, 0] + (sm * (mx - top).exp()).sum(1).log()).contiguous()  # [H, G*W]
    P = n - W
    scores = empty(P, dtype=torch.float32, device=k.device)
    if P:
        _tsp_scores_kernel[(triton.cdiv(P, BLOCK_N),)](q_win, k, lse, scores, P, H, W, G, float(scale), 1.0 / Hq,
                                                       *strides, **kw)
    return scores


def tsp_select(q_win: torch.Tensor, k: torch.Tensor, keep: int, scale: float, pool: int = POOL) -> torch.Tensor:
    """Positions [min(n, keep)] int64, sorted, of the tokens that propagate past the TSP layer: the last
    W = q_win.shape[0] (the observation window) and the keep - W best pooled scores before them. q_win [W, Hq, D]:
    the window's post-RoPE queries; k [n, H, D]: the prompt's post-RoPE keys."""
    check_args(q_win, k, keep, pool)
    n, W = k.shape[0], q_win.shape[0]
    if n <= keep:
        return torch.arange(n, device=k.device)
    return pick_tokens(tsp_scores(q_win, k, scale), n, keep, W, pool)
