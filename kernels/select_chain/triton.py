"""Triton select_chain: one program per (row, KV head) pools, replays and selects (each stage's stores reach the
next through a barrier); rows too long for select_slots' one-stage top-k take the three launches instead."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._alloc import empty
from .._utils import check_device, check_index_vectors
from ..churn_replay.naive import PROMOTED, TIE, check_rate
from ..churn_replay.triton import CHURN_BLOCK, _replay_row, keep_arg, replay_churn
from ..page_rerank.triton import POOL_BLOCK, _full_scan, _pool, _pool_row
from ..page_select.triton import _heads_args, _select_row, one_stage, select_launch, select_slots
from .naive import LsePool, Replay, check_pool


@triton.jit
def _select_chain_kernel(
    H,
    lse_ptr, cend_ptr, C, cand_start, sl_b, sl_h, sl_c, s_cend,
    draws_ptr, keep_ptr, rate_k, returns, sd_b, sd_h, sk_b, sk_h,
    in_ptr, slots_ptr, req_ptr, heads_ptr, flags_ptr, recall_ptr, stats_ptr, vict_ptr, age_ptr, vops_ptr,
    n, K, pad_slot, bonus, V, si_b, si_h, si_j, st_r, st_h, st_k, s_req, sh_b, sh_h, sf_b, sf_h, sr_b, sr_h, sr_k,
    sv_r, sv_h, sv_e, sa_r, sa_h, sa_e, so_b, so_h, so_k, row_ptr, m, sw_b, sw_h, sw_j,
    KP: tl.constexpr, CHUNK: tl.constexpr, PACKED_IN: tl.constexpr, PHASE: tl.constexpr, WANT: tl.constexpr,
    RECALL_ALL: tl.constexpr, STATS: tl.constexpr, NEG_INF_KEY: tl.constexpr, HYST: tl.constexpr,
    VICTIMS: tl.constexpr, VP: tl.constexpr, HIT_STATS: tl.constexpr, SHIFT: tl.constexpr, SCRATCH: tl.constexpr,
    POOL: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, POOL_BLOCK: tl.constexpr,
    REPLAY: tl.constexpr, R_KP: tl.constexpr, R_BLOCK: tl.constexpr, PROMOTED: tl.constexpr, TIE: tl.constexpr,
    KEEP: tl.constexpr,
):
    """Row b, KV head h of the phase: POOL, the scores row in_ptr[b, h] from the log-sum-exps (_pool_row); REPLAY,
    the replay's scores over it (_replay_row); then, for every head, _select_row, which reads that row."""
    pid = tl.program_id(0)
    b = (pid // H).to(tl.int64)
    h = (pid % H).to(tl.int64)
    if tl.load(heads_ptr + b * sh_b + h * sh_h).to(tl.int32) == WANT:
        if POOL:
            _pool_row(b, h, lse_ptr, lse_ptr, cend_ptr, in_ptr, C, cand_start, n, sl_b, sl_h, sl_c, 0, 0, 0, s_cend,
                      si_b, si_h, si_j, G, GP, POOL_BLOCK, False)
            tl.debug_barrier()  # every thread's scores land before the replay and the top-k read them
        if REPLAY:
            _replay_row(b, h, in_ptr, slots_ptr, req_ptr, draws_ptr, vict_ptr, keep_ptr, rate_k, returns, n, K, V,
                        si_b, si_h, si_j, st_r, st_h, st_k, sd_b, sd_h, sv_r, sv_h, sv_e, sk_b, sk_h, R_KP, R_BLOCK,
                        PROMOTED, TIE, VICTIMS, VP, KEEP)
            tl.debug_barrier()
    _select_row(
        b, h,
        in_ptr, slots_ptr, req_ptr, heads_ptr, flags_ptr, recall_ptr, stats_ptr, vict_ptr, age_ptr, vops_ptr,
        n, K, pad_slot, bonus, V, si_b, si_h, si_j, st_r, st_h, st_k, s_req, sh_b, sh_h, sf_b, sf_h, sr_b, sr_h, sr_k,
        sv_r, sv_h, sv_e, sa_r, sa_h, sa_e, so_b, so_h, so_k, row_ptr, m, sw_b, sw_h, sw_j,
        KP, CHUNK, PACKED_IN, PHASE, WANT, RECALL_ALL, STATS, NEG_INF_KEY, HYST, VICTIMS, VP, HIT_STATS, SHIFT,
        SCRATCH)


def select_chain(
    scores: torch.Tensor | LsePool,
    slots: torch.Tensor,
    req_slots: torch.Tensor,
    heads: torch.Tensor,
    phase: int,
    flags: torch.Tensor | None,
    recall: torch.Tensor,
    recall_all: bool = False,
    stats: torch.Tensor | None = None,
    pad_slot: int = -1,
    hysteresis: float = 0.0,
    victims: torch.Tensor | None = None,
    victim_age: torch.Tensor | None = None,
    victim_ops: torch.Tensor | None = None,
    replay: Replay | None = None,
) -> None:
    """See naive_select_chain. Scores given and no replay: select_slots itself."""
    B, H = req_slots.shape[0], slots.shape[1]
    pool = scores if isinstance(scores, LsePool) else None
    if pool is not None:
        check_pool(pool, B, H)
        check_device(pool.lse, pool.cand_end)
        check_index_vectors(cand_end=pool.cand_end)
        scores = empty(B, H, pool.num_pages, dtype=torch.float32, device=pool.lse.device)
    if replay is not None:
        check_rate(replay.rate)
        check_rate(replay.returns)
        if replay.returns and victims is None:
            raise ValueError("a return share needs the victim cache the pages return from")
        check_device(replay.draws)
        assert replay.draws.dtype == torch.float32 and replay.draws.shape == (B, H)
    select = (slots, req_slots, heads, phase, flags, recall, recall_all, stats, pad_slot, hysteresis, victims,
              victim_age, victim_ops)
    if pool is None and replay is None:
        return select_slots(scores, *select)
    if not one_stage(scores.shape[2], slots.shape[2]):  # the staged top-k reads the scores from its first launch
        if pool is not None:
            C, cand_args = _full_scan(req_slots, pool.cand_start, pool.cand_end, pool.num_pages)
            _pool(pool.lse, cand_args, False, _heads_args(heads, phase, req_slots), scores, C, pool.cand_start,
                  pool.group)
        if replay is not None:
            replay_churn(scores, slots, req_slots, heads, phase, replay.draws, replay.rate, victims, replay.returns,
                         replay.keep)
        return select_slots(scores, *select, scratch=pool is not None)
    # Pooled here, the scores are this launch's own: the slot delta and the victim moves may go through them.
    launch = select_launch(scores, *select, scratch=pool is not None)
    if launch is None:
        return None
    args, constexprs, num_warps = launch
    lse = scores if pool is None else pool.lse
    cend = req_slots if pool is None else pool.cand_end
    draws = scores if replay is None else replay.draws
    keep = keep_arg(None if replay is None else replay.keep, B, H, draws)
    K = slots.shape[2]
    _select_chain_kernel[(B * H,)](
        H,
        lse, cend, 0 if pool is None else max(pool.num_pages - pool.cand_start, 0),
        0 if pool is None else pool.cand_start, *lse.stride()[:3], cend.stride(0),
        draws, keep, 0.0 if replay is None else float(replay.rate * K),
        0.0 if replay is None else float(replay.returns), *draws.stride()[:2], *keep.stride()[:2],
        *args, **constexprs,
        POOL=pool is not None, G=1 if pool is None else pool.group, GP=1 if pool is None else lse.shape[3],
        POOL_BLOCK=POOL_BLOCK, REPLAY=replay is not None, R_KP=triton.next_power_of_2(max(K, 1)), R_BLOCK=CHURN_BLOCK,
        PROMOTED=PROMOTED, TIE=TIE, KEEP=replay is not None and replay.keep is not None,
        num_warps=num_warps,
    )
    return None
