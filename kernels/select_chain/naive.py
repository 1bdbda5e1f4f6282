"""Torch reference for select_chain: the pooling, the replay and select_slots' references in a row."""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..churn_replay.naive import naive_replay_churn
from ..page_select.naive import in_phase, naive_select_slots
from ..recall.naive import naive_recall_pages
from ..token_index.naive import naive_head_token_index


class LsePool(NamedTuple):
    """Page scores still to be pooled: lse [B, H, max(C, 1), GP] fp32 (channel_sketch_pages with pool=False),
    lse[b, h, c, g] the log-sum-exp of query head g over the tokens of page cand_start + c, for c below the row's
    candidate end min(cand_end[b], num_pages) - cand_start; group query heads per KV head, GP its power of two."""
    lse: torch.Tensor
    cand_start: int
    cand_end: torch.Tensor
    group: int
    num_pages: int


class Replay(NamedTuple):
    """replay_churn's arguments (benchmarks only): draws [B, H], rate, returns (with the victim cache)."""
    draws: torch.Tensor
    rate: float
    returns: float = 0.0


class RecallNow(NamedTuple):
    """recall_pages' arguments that the selection does not hold: with them select_chain also recalls its phase's
    entries, each (row, KV head)'s program its own (in_flight chunks at a time), instead of a recall launch after."""
    host_layer: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    page_table: torch.Tensor
    slot_pages: torch.Tensor
    page_size: int
    victim_base: int = 0
    victim_entries: int = 0
    host_scales: torch.Tensor | None = None
    in_flight: int = 2


class TokenLists(NamedTuple):
    """head_token_index's arguments after the slot table and req_slots, in its order: with them select_chain also
    writes every (row, KV head)'s token list (and query rows, given q and q_rows) from the committed slots."""
    row_table: torch.Tensor
    n_sink: torch.Tensor
    n_slots: torch.Tensor
    slot_pages: torch.Tensor
    row_tokens: torch.Tensor
    row_start: torch.Tensor
    page_size: int
    out: torch.Tensor
    q: torch.Tensor | None = None
    q_rows: torch.Tensor | None = None


def after_selection(slots: torch.Tensor, req_slots: torch.Tensor, phase: int, recall: torch.Tensor,
                    victim_ops: torch.Tensor | None, recall_now: RecallNow | None, lists: TokenLists | None,
                    recall_fn=naive_recall_pages, lists_fn=naive_head_token_index) -> None:
    """What select_chain does after the commit, as the ops it replaces: the token lists, then the recall."""
    if lists is not None:
        lists_fn(slots, req_slots, *lists)
    if recall_now is not None:
        rn = recall_now
        cache = {} if victim_ops is None else dict(victim_ops=victim_ops, victim_base=rn.victim_base,
                                                   victim_entries=rn.victim_entries)
        recall_fn(rn.host_layer, rn.k_cache, rn.v_cache, rn.page_table, slots, req_slots, rn.slot_pages, recall, phase,
                  rn.page_size, host_scales=rn.host_scales, **cache)


def check_pool(pool: LsePool, batch: int, num_kv_heads: int) -> None:
    lse = pool.lse
    gp = 1 << (pool.group - 1).bit_length()
    if lse.dtype != torch.float32 or lse.shape != (batch, num_kv_heads, max(pool.num_pages - pool.cand_start, 1), gp):
        raise ValueError(f"lse must be fp32 [{batch}, {num_kv_heads}, "
                         f"{max(pool.num_pages - pool.cand_start, 1)}, {gp}], got {lse.dtype} {tuple(lse.shape)}")
    if pool.cand_end.shape != (batch,):
        raise ValueError(f"cand_end must hold one entry per row ({batch}), got {tuple(pool.cand_end.shape)}")


def naive_pool_lse(pool: LsePool, heads: torch.Tensor, phase: int) -> torch.Tensor:
    """scores [B, H, num_pages] of the phase's heads: per query head a softmax over the row's candidate pages, the
    mean over the group, -inf at every other page (as the pooling kernel computes it); other heads' rows NaN."""
    lse, G, M, s = pool.lse, pool.group, pool.num_pages, pool.cand_start
    B, H = lse.shape[:2]
    mine = in_phase(heads, phase)
    scores = torch.full((B, H, M), float("nan"), dtype=torch.float32, device=lse.device)
    for b in range(B):
        n = max(0, min(M - s, min(int(pool.cand_end[b]), M) - s))
        for h in range(H):
            if not mine[b, h]:
                continue
            scores[b, h] = float("-inf")
            if n:
                x = lse[b, h, :n, :G]
                e = torch.exp(x - x.max(dim=0).values)
                scores[b, h, s:s + n] = (e / e.sum(dim=0).clamp_min(1.0)).sum(dim=1) / G
    return scores


def naive_select_chain(
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
    """naive_select_slots (its arguments, its effects) over `scores`: page scores [B, H, M] (changed in place), or
    an LsePool pooled first (naive_pool_lse); with `replay`, naive_replay_churn rewrites the phase's scores
    between (the victim cache is select_slots'). Then, from the committed slots: with `lists`,
    naive_head_token_index for every (row, KV head); with `recall_now`, naive_recall_pages of the phase's entries
    (through victim_ops when the victim cache is on)."""
    if isinstance(scores, LsePool):
        check_pool(scores, req_slots.shape[0], slots.shape[1])
        scores = naive_pool_lse(scores, heads, phase)
    if replay is not None:
        naive_replay_churn(scores, slots, req_slots, heads, phase, replay.draws, replay.rate, victims, replay.returns)
    naive_select_slots(scores, slots, req_slots, heads, phase, flags, recall, recall_all, stats, pad_slot, hysteresis,
                       victims, victim_age, victim_ops)
    after_selection(slots, req_slots, phase, recall, victim_ops if victims is not None else None, recall_now, lists)
