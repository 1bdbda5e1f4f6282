"""Torch reference for unit_page_scores (see docs/kernels.md).

A request's retrieval units (LouisKV's prompt clusters and output segments) are numbered by ordinal u; unit u of a
request r lives in row page_table[r, cand_start + u // upp] * upp + u % upp of the unit table (upp rows per host
page), so the table is indexed by host page like the page summaries and follows a page wherever it goes. A unit
with count 0 is empty. Candidate page j's tokens belong to the units with ordinals ranges[hp, h, 0] ..
ranges[hp, h, 1] (hp its host page), which may start or end on other pages.
"""

from __future__ import annotations

import torch

from ..page_select.naive import PHASE_NOW, in_phase


def unit_rows(page_table_row: torch.Tensor, cand_start: int, n_units: int, upp: int) -> torch.Tensor:
    """[n_units] int64: the unit-table rows of a request's ordinals 0 .. n_units - 1."""
    u = torch.arange(n_units, device=page_table_row.device)
    return page_table_row[cand_start + u // upp].long() * upp + u % upp


def naive_unit_page_scores(
    q: torch.Tensor,
    centroids: torch.Tensor,
    counts: torch.Tensor,
    ranges: torch.Tensor,
    page_table: torch.Tensor,
    req_slots: torch.Tensor,
    cand_start: int,
    cand_end: torch.Tensor,
    scale: float,
    page_size: int,
    heads: torch.Tensor,
    phase: int = PHASE_NOW,
    scratch: torch.Tensor | None = None,
) -> torch.Tensor:
    """[B, H, M] float32 for the heads of `phase`: per query head of KV head h the softmax over the request's
    non-empty units (ordinals below (cand_end - cand_start) * upp) of scale * q . centroid, mean over the group
    (LouisKV's group-consistent A); then each candidate page [cand_start, cand_end) scores the best A of its units,
    every other page -inf. A page of page_size tokens has at most page_size units. Rows of the other heads are left
    unwritten (NaN here). `scratch` is the kernel's."""
    mine = in_phase(heads, phase)
    B, H, M = req_slots.shape[0], centroids.shape[1], page_table.shape[1]
    G = q.shape[1] // H
    upp = centroids.shape[0] // ranges.shape[0]
    scores = torch.full((B, H, M), float("nan"), dtype=torch.float32, device=q.device)
    for b, slot in enumerate(req_slots.tolist()):
        end = min(int(cand_end[b]), M)
        n_units = max(end - cand_start, 0) * upp
        rows = unit_rows(page_table[slot], cand_start, n_units, upp)
        for h in range(H):
            if not mine[b, h]:
                continue
            scores[b, h] = float("-inf")
            if n_units == 0:
                continue
            cent = centroids[rows, h].float()  # [U, D]
            logits = scale * (q[b, h * G:(h + 1) * G].float()[:, None, :] * cent[None]).sum(-1)  # [G, U]
            logits = logits.masked_fill(counts[rows, h][None] == 0, float("-inf"))
            a = torch.softmax(logits, dim=-1).mean(0).masked_fill(counts[rows, h] == 0, float("-inf"))
            # Page j's best unit among ordinals first .. last (at most page_size of them).
            first, last = ranges[page_table[slot, cand_start:end].long(), h].long().unbind(-1)  # [pages]
            u = first[:, None] + torch.arange(page_size, device=q.device)[None, :]  # [pages, page_size]
            mine_u = torch.where(u <= last[:, None], a[u.clamp(max=n_units - 1)], float("-inf"))
            scores[b, h, cand_start:end] = mine_u.max(-1).values
    return scores
