"""Triton replay_churn: one program per (row, KV head)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._utils import check_device, check_index_vectors
from ..page_select.triton import _heads_args
from .naive import PROMOTED, TIE, check_rate


@triton.jit
def _page_draws(seed, pages):
    """page_draws (naive.py) in wrapping uint32 arithmetic (one multiply each, where int64 takes several): the same
    hash, bit for bit. seed: uint32, pages: int32."""
    x = seed ^ (pages.to(tl.uint32) * tl.full([], 0x61C88647, tl.uint32))
    x = x ^ (x >> 16)
    x = x * tl.full([], 0x7FEB352D, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full([], 0x5BD1E995, tl.uint32)
    x = x ^ (x >> 16)
    return (x >> 8).to(tl.float32) * (1.0 / 16777216.0)


@triton.jit
def _replay_churn_kernel(
    scores_ptr, slots_ptr, req_ptr, heads_ptr, draws_ptr, vict_ptr, keep_ptr, rate_k, returns, M, K, V,
    ss_b, ss_h, ss_m,
    st_r, st_h, st_k,
    sh_b, sh_h,
    sd_b, sd_h,
    sv_r, sv_h, sv_e,
    sk_b, sk_h,
    HEADS: tl.constexpr, WANT: tl.constexpr, KP: tl.constexpr, BLOCK: tl.constexpr, PROMOTED: tl.constexpr,
    TIE: tl.constexpr, VICTIMS: tl.constexpr, VP: tl.constexpr, KEEP: tl.constexpr,
):
    """_replay_row for the heads of the phase."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    if HEADS:  # noqa: SIM102 (a constexpr branch around a runtime one)
        if tl.load(heads_ptr + b * sh_b + h * sh_h).to(tl.int32) != WANT:
            return
    _replay_row(b, h, scores_ptr, slots_ptr, req_ptr, draws_ptr, vict_ptr, keep_ptr, rate_k, returns, M, K, V, ss_b,
                ss_h, ss_m, st_r, st_h, st_k, sd_b, sd_h, sv_r, sv_h, sv_e, sk_b, sk_h, KP, BLOCK, PROMOTED, TIE,
                VICTIMS, VP, KEEP)


@triton.jit
def _replay_row(
    b, h, scores_ptr, slots_ptr, req_ptr, draws_ptr, vict_ptr, keep_ptr, rate_k, returns, M, K, V, ss_b, ss_h, ss_m,
    st_r, st_h, st_k, sd_b, sd_h, sv_r, sv_h, sv_e, sk_b, sk_h,
    KP: tl.constexpr, BLOCK: tl.constexpr, PROMOTED: tl.constexpr, TIE: tl.constexpr, VICTIMS: tl.constexpr,
    VP: tl.constexpr, KEEP: tl.constexpr,
):
    """The replay's scores of row b, KV head h, in place (naive_replay_churn)."""
    if KEEP:  # a kept head: rate 0
        rate_k = tl.where(tl.load(keep_ptr + b * sk_b + h * sk_h).to(tl.int32) != 0, 0.0, rate_k)
    r = tl.load(req_ptr + b).to(tl.int64)
    row = scores_ptr + b * ss_b + h * ss_h
    seed = tl.load(draws_ptr + b * sd_b + h * sd_h).to(tl.uint32, bitcast=True)
    j = tl.arange(0, KP)
    own = tl.load(slots_ptr + r * st_r + h * st_h + j * st_k, mask=j < K, other=-1)
    own_score = tl.load(row + own.to(tl.int64) * ss_m, mask=own >= 0, other=float("-inf"))
    held = tl.sum((own_score > float("-inf")).to(tl.int32), axis=0)
    i = tl.arange(0, BLOCK)
    n = 0
    for m0 in range(0, M, BLOCK):
        x = tl.load(row + (m0 + i).to(tl.int64) * ss_m, mask=m0 + i < M, other=float("-inf"))
        n += tl.sum((x > float("-inf")).to(tl.int32), axis=0)
    n_back = 0
    if VICTIMS:  # the returning candidates: in a victim entry, finite, not held
        e = tl.arange(0, VP)
        back = tl.load(vict_ptr + r * sv_r + h * sv_h + e * sv_e, mask=e < V, other=-1)
        back_score = tl.load(row + back.to(tl.int64) * ss_m, mask=back >= 0, other=float("-inf"))
        is_held = tl.max((back[:, None] == own[None, :]).to(tl.int32), axis=1) > 0
        back_ok = (back_score > float("-inf")) & ~is_held
        n_back = tl.sum(back_ok.to(tl.int32), axis=0)
    p = (1.0 - returns) * rate_k / tl.maximum(n - held - n_back, 1).to(tl.float32)
    for m0 in range(0, M, BLOCK):
        m = m0 + i
        x = tl.load(row + m.to(tl.int64) * ss_m, mask=m < M, other=float("-inf"))
        u = _page_draws(seed, m)
        new = tl.where(u < p, PROMOTED + u, u * TIE)
        tl.store(row + m.to(tl.int64) * ss_m, new, mask=(m < M) & (x > float("-inf")))
    tl.debug_barrier()  # the stores below come after every thread's store above
    if VICTIMS:
        u = _page_draws(seed, back)
        p_back = returns * rate_k / tl.maximum(n_back, 1).to(tl.float32)
        tl.store(row + back.to(tl.int64) * ss_m, tl.where(u < p_back, PROMOTED + u, u * TIE), mask=back_ok)
    tl.store(row + own.to(tl.int64) * ss_m, 1.0 + _page_draws(seed, own) * TIE, mask=own_score > float("-inf"))


CHURN_BLOCK = 1024


def replay_churn(
    scores: torch.Tensor,
    slots: torch.Tensor,
    req_slots: torch.Tensor,
    heads: torch.Tensor | None,
    phase: int,
    draws: torch.Tensor,
    rate: float,
    victims: torch.Tensor | None = None,
    returns: float = 0.0,
    keep: torch.Tensor | None = None,
) -> None:
    """See naive_replay_churn."""
    check_rate(rate)
    check_rate(returns)
    if returns and victims is None:
        raise ValueError("a return share needs the victim cache the pages return from")
    check_device(scores, slots, req_slots, draws)
    check_index_vectors(req_slots=req_slots)
    B, H, M = scores.shape
    K = slots.shape[2]
    assert scores.dtype == torch.float32 and draws.dtype == torch.float32 and draws.shape == (B, H)
    assert slots.shape[1] == H and req_slots.shape[0] == B
    heads_arg, heads_strides, with_heads, want = _heads_args(heads, phase, req_slots)
    if B * H == 0:
        return
    vt = slots if victims is None else victims
    if victims is not None:
        check_device(victims)
        assert victims.shape[:2] == slots.shape[:2] and victims.dtype == torch.int32
    kp = keep_arg(keep, B, H, draws)
    _replay_churn_kernel[(B, H)](
        scores, slots, req_slots, heads_arg, draws, vt, kp, float(rate * K), float(returns), M, K, vt.shape[2],
        *scores.stride(), *slots.stride(), *heads_strides, *draws.stride(), *vt.stride(), *kp.stride(),
        HEADS=with_heads, WANT=want, KP=triton.next_power_of_2(max(K, 1)), BLOCK=CHURN_BLOCK, PROMOTED=PROMOTED,
        TIE=TIE, VICTIMS=victims is not None, VP=max(2, triton.next_power_of_2(vt.shape[2])), KEEP=keep is not None,
        num_warps=4,
    )


def keep_arg(keep: torch.Tensor | None, B: int, H: int, placeholder: torch.Tensor) -> torch.Tensor:
    """keep [B, H] bool as the kernels take it (a byte view), or without it `placeholder` ([B, H] on the device),
    which they never read."""
    if keep is None:
        return placeholder
    check_device(keep)
    assert keep.dtype == torch.bool and keep.shape == (B, H), (keep.dtype, tuple(keep.shape))
    return keep.view(torch.uint8)
