"""Triton select_chain: one program per (row, KV head) pools, replays and selects (each stage's stores reach the
next through a barrier); rows too long for select_slots' one-stage top-k take the three launches instead."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._alloc import empty
from .._utils import check_device, check_index_vectors
from ..churn_replay.naive import PROMOTED, TIE, check_rate
from ..churn_replay.triton import CHURN_BLOCK, _replay_row, replay_churn
from ..page_rerank.triton import POOL_BLOCK, _full_scan, _pool, _pool_row
from ..page_select.triton import _heads_args, _select_row, one_stage, select_launch, select_slots
from ..recall.triton import _recall_row, check_recall, recall_pages
from ..token_index.triton import _EMPTY_KEY, _SLOTS, _TILE, _head_token_row, check_lists, head_token_index
from .naive import LsePool, RecallNow, Replay, TokenLists, after_selection, check_pool


@triton.jit
def _select_chain_kernel(
    H,
    lse_ptr, cend_ptr, C, cand_start, sl_b, sl_h, sl_c, s_cend,
    draws_ptr, rate_k, returns, sd_b, sd_h,
    in_ptr, slots_ptr, req_ptr, heads_ptr, flags_ptr, recall_ptr, stats_ptr, vict_ptr, age_ptr, vops_ptr,
    n, K, pad_slot, bonus, V, si_b, si_h, si_j, st_r, st_h, st_k, s_req, sh_b, sh_h, sf_b, sf_h, sr_b, sr_h, sr_k,
    sv_r, sv_h, sv_e, sa_r, sa_h, sa_e, so_b, so_h, so_k, row_ptr, m, sw_b, sw_h, sw_j,
    KP: tl.constexpr, CHUNK: tl.constexpr, PACKED_IN: tl.constexpr, PHASE: tl.constexpr, WANT: tl.constexpr,
    RECALL_ALL: tl.constexpr, STATS: tl.constexpr, NEG_INF_KEY: tl.constexpr, HYST: tl.constexpr,
    VICTIMS: tl.constexpr, VP: tl.constexpr, HIT_STATS: tl.constexpr, SHIFT: tl.constexpr, SCRATCH: tl.constexpr,
    POOL: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, POOL_BLOCK: tl.constexpr,
    REPLAY: tl.constexpr, R_KP: tl.constexpr, R_BLOCK: tl.constexpr, PROMOTED: tl.constexpr, TIE: tl.constexpr,
    lrow_ptr, nsink_ptr, nslots_ptr, lpages_ptr, tokens_ptr, start_ptr, lout_ptr, q_ptr, qr_ptr,
    lr_b, lr_i, lg_b, lg_k, lq_b, lq_h, lq_d,
    LISTS: tl.constexpr, L_PAGE: tl.constexpr, L_SB: tl.constexpr, L_PB: tl.constexpr, L_EMPTY: tl.constexpr,
    L_Q: tl.constexpr, L_G: tl.constexpr, L_GP: tl.constexpr, L_D: tl.constexpr, L_DP: tl.constexpr,
    host_ptr, exp_ptr, k_ptr, v_ptr, pt_ptr, spages_ptr, victim_base,
    s_hp, s_hh, s_hkv, s_ht, s_ep, s_eh, s_ekv, s_et, s_kt, s_kh, s_vt, s_vh, spt_r, spt_m, sg_b, sg_k,
    RECALL: tl.constexpr, C_PAGE: tl.constexpr, C_D: tl.constexpr, C_SCALED: tl.constexpr, C_M: tl.constexpr,
):
    """Row b, KV head h of the phase: POOL, the scores row in_ptr[b, h] from the log-sum-exps (_pool_row); REPLAY,
    the replay's scores over it (_replay_row); then, for every head, _select_row, which reads that row. After the
    commit, every program: LISTS, its (row, head)'s token list (_head_token_row); RECALL, its entries of the phase
    recalled (_recall_row)."""
    pid = tl.program_id(0)
    b = (pid // H).to(tl.int64)
    h = (pid % H).to(tl.int64)
    if tl.load(heads_ptr + b * sh_b + h * sh_h).to(tl.int32) == WANT:
        if POOL:
            _pool_row(b, h, lse_ptr, lse_ptr, cend_ptr, in_ptr, C, cand_start, n, sl_b, sl_h, sl_c, 0, 0, 0, s_cend,
                      si_b, si_h, si_j, G, GP, POOL_BLOCK, False)
            tl.debug_barrier()  # every thread's scores land before the replay and the top-k read them
        if REPLAY:
            _replay_row(b, h, in_ptr, slots_ptr, req_ptr, draws_ptr, vict_ptr, rate_k, returns, n, K, V, si_b, si_h,
                        si_j, st_r, st_h, st_k, sd_b, sd_h, sv_r, sv_h, sv_e, R_KP, R_BLOCK, PROMOTED, TIE, VICTIMS, VP)
            tl.debug_barrier()
    _select_row(
        b, h,
        in_ptr, slots_ptr, req_ptr, heads_ptr, flags_ptr, recall_ptr, stats_ptr, vict_ptr, age_ptr, vops_ptr,
        n, K, pad_slot, bonus, V, si_b, si_h, si_j, st_r, st_h, st_k, s_req, sh_b, sh_h, sf_b, sf_h, sr_b, sr_h, sr_k,
        sv_r, sv_h, sv_e, sa_r, sa_h, sa_e, so_b, so_h, so_k, row_ptr, m, sw_b, sw_h, sw_j,
        KP, CHUNK, PACKED_IN, PHASE, WANT, RECALL_ALL, STATS, NEG_INF_KEY, HYST, VICTIMS, VP, HIT_STATS, SHIFT,
        SCRATCH)
    if LISTS or RECALL:
        tl.debug_barrier()  # the commit's stores (slots, codes, victim ops) land before this program reads them
    if LISTS:
        _head_token_row(b, h, slots_ptr, req_ptr, lrow_ptr, nsink_ptr, nslots_ptr, lpages_ptr, tokens_ptr, start_ptr,
                        lout_ptr, q_ptr, qr_ptr, H, K, st_r, st_h, st_k, lr_b, lr_i, lg_b, lg_k, lq_b, lq_h, lq_d,
                        L_PAGE, L_SB, L_PB, L_EMPTY, L_Q, L_G, L_GP, L_D, L_DP)
    if RECALL:
        r = tl.load(req_ptr + b * s_req).to(tl.int64)
        _recall_row(host_ptr, exp_ptr, k_ptr, v_ptr, pt_ptr, slots_ptr, spages_ptr, recall_ptr, vops_ptr, b, h, r, K,
                    victim_base, V, s_hp, s_hh, s_hkv, s_ht, s_ep, s_eh, s_ekv, s_et, s_kt, s_kh, s_vt, s_vh, spt_r,
                    spt_m, st_r, st_h, st_k, sg_b, sg_k, sr_b, sr_h, sr_k, so_b, so_h, so_k,
                    PHASE, C_PAGE, C_D, KP, VICTIMS, SHIFT, C_SCALED, C_M)


_LIST_ARGS = ("lrow_ptr", "nsink_ptr", "nslots_ptr", "lpages_ptr", "tokens_ptr", "start_ptr", "lout_ptr", "q_ptr",
              "qr_ptr", "lr_b", "lr_i", "lg_b", "lg_k", "lq_b", "lq_h", "lq_d")
_RECALL_ARGS = ("host_ptr", "exp_ptr", "k_ptr", "v_ptr", "pt_ptr", "spages_ptr", "victim_base", "s_hp", "s_hh", "s_hkv",
                "s_ht", "s_ep", "s_eh", "s_ekv", "s_et", "s_kt", "s_kh", "s_vt", "s_vh", "spt_r", "spt_m", "sg_b",
                "sg_k")


def _lists_launch(lists: TokenLists | None, slots: torch.Tensor, req_slots: torch.Tensor) -> dict:
    """The token lists' kernel arguments and constexprs by name (head_token_index's checks), placeholders without."""
    if lists is None:
        return dict(zip(_LIST_ARGS, (slots,) * 9 + (0,) * 7), LISTS=False, L_PAGE=1, L_SB=1, L_PB=1,
                    L_EMPTY=_EMPTY_KEY, L_Q=False, L_G=1, L_GP=1, L_D=1, L_DP=1)
    lt, K = lists, slots.shape[2]
    G, D = check_lists(slots, req_slots, *lists)
    q, qr = (slots, slots) if lt.q is None else (lt.q, lt.q_rows)
    args = (lt.row_table, lt.n_sink, lt.n_slots, lt.slot_pages, lt.row_tokens, lt.row_start, lt.out, q, qr,
            *lt.row_table.stride(), *lt.slot_pages.stride(), *((0, 0, 0) if lt.q is None else lt.q.stride()))
    return dict(zip(_LIST_ARGS, args), LISTS=True, L_PAGE=lt.page_size,
                L_SB=min(triton.next_power_of_2(max(K, 1)), _SLOTS), L_PB=_TILE // lt.page_size, L_EMPTY=_EMPTY_KEY,
                L_Q=lt.q is not None, L_G=G, L_GP=triton.next_power_of_2(G), L_D=D, L_DP=triton.next_power_of_2(D))


def _recall_launch(rn: RecallNow | None, slots: torch.Tensor, req_slots: torch.Tensor, recall: torch.Tensor,
                   victim_ops: torch.Tensor | None) -> dict:
    """The recall's kernel arguments and constexprs by name (recall_pages' checks), placeholders without it."""
    if rn is None:
        return dict(zip(_RECALL_ARGS, (slots,) * 6 + (0,) * 17), RECALL=False, C_PAGE=1, C_D=1, C_SCALED=False,
                    C_M=1)
    hl, D = rn.host_layer, rn.host_layer.shape[-1]
    scaled = check_recall(hl, rn.k_cache, rn.v_cache, rn.page_table, slots, req_slots, rn.slot_pages, recall,
                          rn.page_size, victim_ops, rn.victim_base, rn.victim_entries, rn.host_scales)
    if rn.in_flight < 1 or rn.in_flight & (rn.in_flight - 1):
        raise ValueError(f"in_flight must be a power of two, got {rn.in_flight!r}")
    args = (hl, rn.host_scales if scaled else recall, rn.k_cache, rn.v_cache, rn.page_table, rn.slot_pages,
            rn.victim_base, *hl.stride()[:4], *(rn.host_scales.stride() if scaled else (0, 0, 0, 0)),
            rn.k_cache.stride(0), rn.k_cache.stride(1), rn.v_cache.stride(0), rn.v_cache.stride(1),
            *rn.page_table.stride(), *rn.slot_pages.stride())
    return dict(zip(_RECALL_ARGS, args), RECALL=True, C_PAGE=rn.page_size, C_D=D, C_SCALED=scaled, C_M=rn.in_flight)


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
    recall_now: RecallNow | None = None,
    lists: TokenLists | None = None,
) -> None:
    """See naive_select_chain. Scores given and no replay: select_slots itself (then the lists' and the recall's
    launches, as past 1,024 pages, where the staged top-k takes several launches anyway)."""
    B, H = req_slots.shape[0], slots.shape[1]
    ops = victim_ops if victims is not None else None
    if recall_now is not None and victims is not None and recall_now.victim_entries != victims.shape[2]:
        raise ValueError(f"recall_now names {recall_now.victim_entries} victim entries a head, the victim cache holds "
                         f"{victims.shape[2]}")
    after = (slots, req_slots, phase, recall, ops, recall_now, lists, recall_pages, head_token_index)
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
        select_slots(scores, *select)
        return after_selection(*after)
    if not one_stage(scores.shape[2], slots.shape[2]):  # the staged top-k reads the scores from its first launch
        if pool is not None:
            C, cand_args = _full_scan(req_slots, pool.cand_start, pool.cand_end, pool.num_pages)
            _pool(pool.lse, cand_args, False, _heads_args(heads, phase, req_slots), scores, C, pool.cand_start,
                  pool.group)
        if replay is not None:
            replay_churn(scores, slots, req_slots, heads, phase, replay.draws, replay.rate, victims, replay.returns)
        select_slots(scores, *select, scratch=pool is not None)
        return after_selection(*after)
    # Pooled here, the scores are this launch's own: the slot delta and the victim moves may go through them.
    launch = select_launch(scores, *select, scratch=pool is not None)
    if launch is None:
        return after_selection(*after)
    args, constexprs, num_warps = launch
    after_args = {**_lists_launch(lists, slots, req_slots), **_recall_launch(recall_now, slots, req_slots, recall, ops)}
    lse = scores if pool is None else pool.lse
    cend = req_slots if pool is None else pool.cand_end
    draws = scores if replay is None else replay.draws
    K = slots.shape[2]
    _select_chain_kernel[(B * H,)](
        H,
        lse, cend, 0 if pool is None else max(pool.num_pages - pool.cand_start, 0),
        0 if pool is None else pool.cand_start, *lse.stride()[:3], cend.stride(0),
        draws, 0.0 if replay is None else float(replay.rate * K), 0.0 if replay is None else float(replay.returns),
        *draws.stride()[:2],
        *args, **constexprs,
        POOL=pool is not None, G=1 if pool is None else pool.group, GP=1 if pool is None else lse.shape[3],
        POOL_BLOCK=POOL_BLOCK, REPLAY=replay is not None, R_KP=triton.next_power_of_2(max(K, 1)), R_BLOCK=CHURN_BLOCK,
        PROMOTED=PROMOTED, TIE=TIE,
        **after_args,
        num_warps=num_warps if recall_now is None else max(num_warps, 8),  # the recall's tiles: 32 values a thread
    )
    return None
