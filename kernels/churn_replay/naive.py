"""Torch reference for replay_churn (benchmarks only: FreeKVConfig.replay_churn)."""

from __future__ import annotations

import torch

from ..page_select.naive import in_phase

PROMOTED = 1.0e4  # above any resident page times select_slots' (1 + hysteresis) for hysteresis < 9999
TIE = 1.0 / 1024  # the draw's weight in the scores that only order pages among their kind
_M32 = 0xFFFFFFFF


def check_rate(rate: float) -> None:
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0.0 <= rate <= 1.0:
        raise ValueError(f"churn rate must be a number in [0, 1], got {rate!r}")


def page_draws(seed: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    """u in [0, 1) per (seed, page): a 32-bit integer hash (multipliers below 2^31, so int64 products never
    overflow) of the seed's bits and the page index, the same in the kernel."""
    x = (seed ^ (pages * 0x61C88647)) & _M32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x5BD1E995) & _M32
    x = x ^ (x >> 16)
    return (x >> 8).to(torch.float32) * (1.0 / (1 << 24))


def naive_replay_churn(
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
    """Replace, in place, the scores [B, H, M] of the heads of `phase` by scores that make select_slots replace about
    `rate` of the head's k = slots.shape[2] slots with pages it does not hold, at random: a benchmark's stand-in for
    a real model's selection churn (random weights churn unrealistically much or little).

    Per (row b, KV head h) of the phase, with r = req_slots[b]: the candidates are the pages with a finite score;
    `held` of them are in slots[r, h]; u = page_draws(bits of draws[b, h], page). A held candidate scores 1 + u TIE;
    another candidate PROMOTED + u when u < rate k / max(candidates - held, 1), else u TIE; -inf stays. The top k
    are then the promoted pages (about rate k of them) and the held ones, whatever the hysteresis, so about rate k
    slots change. draws: [B, H] fp32, fresh every step (the engine's replay draws).
    victims ([R, H, V] int32, the victim cache of select_slots) and returns: of the promoted pages, about `returns`
    come back from the head's victim entries, as a real model's selection returns to pages it evicted lately. The
    `returning` candidates (in an entry of victims[r, h], not held) are then promoted when
    u < returns rate k / max(returning, 1), the others when u < (1 - returns) rate k / max(candidates - held -
    returning, 1).
    keep ([B, H] bool): heads replayed at rate 0, which keep the pages they hold (the engine's heads corrected one
    layer early, selected again after attention: a real model's query then barely moved from the predicted one)."""
    check_rate(rate)
    check_rate(returns)
    if returns and victims is None:
        raise ValueError("a return share needs the victim cache the pages return from")
    mine = in_phase(heads, phase)
    k = slots.shape[2]
    seeds = draws.contiguous().view(torch.int32).to(torch.int64) & _M32
    pages = torch.arange(scores.shape[2], device=scores.device, dtype=torch.int64)
    for b, r in enumerate(req_slots.tolist()):
        for h in range(scores.shape[1]):
            if mine is not None and not bool(mine[b, h]):
                continue
            row = scores[b, h]
            cand = torch.isfinite(row)
            held = torch.zeros_like(cand)
            own = slots[r, h].long()
            held[own[own >= 0]] = True
            held &= cand
            back = torch.zeros_like(cand)
            if victims is not None:
                ent = victims[r, h].long()
                back[ent[ent >= 0]] = True
            back &= cand & ~held
            u = page_draws(seeds[b, h], pages)
            n_back = int(back.sum())
            rk = 0.0 if keep is not None and bool(keep[b, h]) else rate * k
            promote = u < (1 - returns) * rk / max(int(cand.sum()) - int(held.sum()) - n_back, 1)
            promote = torch.where(back, u < returns * rk / max(n_back, 1), promote)
            new = torch.where(promote, PROMOTED + u, u * TIE)
            new = torch.where(held, 1.0 + u * TIE, new)
            row.copy_(torch.where(cand, new, row))
