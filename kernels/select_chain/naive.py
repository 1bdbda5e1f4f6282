"""Torch reference for select_chain: the pooling, the replay and select_slots' references in a row."""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..churn_replay.naive import naive_replay_churn
from ..page_select.naive import in_phase, naive_select_slots


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
    """replay_churn's arguments (benchmarks only): draws [B, H], rate, returns (with the victim cache), keep ([B, H]
    bool: heads replayed at rate 0)."""
    draws: torch.Tensor
    rate: float
    returns: float = 0.0
    keep: torch.Tensor | None = None


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
) -> None:
    """naive_select_slots (its arguments, its effects) over `scores`: page scores [B, H, M] (changed in place), or
    an LsePool pooled first (naive_pool_lse); with `replay`, naive_replay_churn rewrites the phase's scores
    between (the victim cache is select_slots')."""
    if isinstance(scores, LsePool):
        check_pool(scores, req_slots.shape[0], slots.shape[1])
        scores = naive_pool_lse(scores, heads, phase)
    if replay is not None:
        naive_replay_churn(scores, slots, req_slots, heads, phase, replay.draws, replay.rate, victims, replay.returns,
                           replay.keep)
    naive_select_slots(scores, slots, req_slots, heads, phase, flags, recall, recall_all, stats, pad_slot, hysteresis,
                       victims, victim_age, victim_ops)
