"""Torch reference for tsp_select (see docs/kernels.md, "tsp_select").

FastKV (section 3.2 and 4.1): at the TSP layer, the last WINDOW prompt queries (the observation window) attend
causally over the whole prompt; each query head's softmax is summed over the window, averaged over all query heads
(one index set for the layer's hidden states), smoothed by a zero-padded average pool of POOL tokens, and the
top (keep - window) tokens before the window propagate, with the window tokens themselves.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

WINDOW = 8  # the paper's observation window N_obs
POOL = 7  # the paper's pooling kernel 2 w_p + 1


def naive_tsp_scores(q_win: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """Per prompt token before the window, the window's softmax attention summed over the window queries and
    averaged over the query heads: [n - W] fp32. q_win [W, Hq, D] are the last W queries, k [n, H, D] the keys
    (both post-RoPE); query head h reads KV head h // (Hq / H)."""
    W, Hq, _ = q_win.shape
    n, H, _ = k.shape
    kq = k.float().repeat_interleave(Hq // H, dim=1)  # [n, Hq, D]
    logits = torch.einsum("whd,nhd->hwn", q_win.float(), kq) * scale
    pos = torch.arange(n, device=k.device)
    visible = pos[None, :] <= (n - W + torch.arange(W, device=k.device))[:, None]  # causal inside the window
    probs = logits.masked_fill(~visible, float("-inf")).softmax(-1)
    return probs[:, :, :n - W].sum(1).mean(0)


def pick_tokens(scores: torch.Tensor, n: int, keep: int, window: int, pool: int) -> torch.Tensor:
    """Sorted positions [keep] int64: the window plus the (keep - window) best pooled scores before it. Ties go to
    the earlier position (a stable sort), so the pick is deterministic."""
    pooled = F.avg_pool1d(scores[None, None], pool, stride=1, padding=pool // 2)[0, 0]
    order = torch.sort(pooled, descending=True, stable=True).indices[:keep - window]
    tail = torch.arange(n - window, n, device=scores.device)
    return torch.cat([order, tail]).sort().values


def check_args(q_win: torch.Tensor, k: torch.Tensor, keep: int, pool: int) -> None:
    W, Hq, D = q_win.shape
    n, H, Dk = k.shape
    if Dk != D or H < 1 or Hq % H:
        raise ValueError(f"q_win [W, Hq, D] {tuple(q_win.shape)} does not fit k [n, H, D] {tuple(k.shape)}")
    if keep <= W:
        raise ValueError(f"keep={keep} must exceed the observation window ({W} tokens), which always propagates")
    if pool < 1 or pool % 2 == 0:
        raise ValueError(f"pool must be a positive odd kernel size, got {pool}")
    if n < W:
        raise ValueError(f"prompt of {n} tokens is shorter than the observation window ({W})")


def naive_tsp_select(q_win: torch.Tensor, k: torch.Tensor, keep: int, scale: float, pool: int = POOL) -> torch.Tensor:
    """Positions [min(n, keep)] int64, sorted, of the tokens that propagate; every token when n <= keep."""
    check_args(q_win, k, keep, pool)
    n, W = k.shape[0], q_win.shape[0]
    if n <= keep:
        return torch.arange(n, device=k.device)
    return pick_tokens(naive_tsp_scores(q_win, k, scale), n, keep, W, pool)
