"""Torch references for the key-code sketch and the two-stage rerank (see docs/kernels.md).

Key codes: every key channel of a page is cut into 4 equal bins of the page's own [lo, hi] range (the page
summary), so a token costs D / 4 bytes per KV head; channels 4j .. 4j+3 sit in byte j, channel 4j + i in bits
2i..2i+1. The bin is counted with exact comparisons, 4 (k - lo) >= i (hi - lo) for i = 1, 2, 3 (no division, so
every device rounds alike; a constant channel gets bin 0), and a code decodes to its bin's centre.

Layout: a code store is indexed [page, head, token, byte] but lies byte-major in memory ([page, head, byte, token],
see empty_codes), so one byte of every token of a page -- four channels of the page -- is one contiguous row: the
sketch (first stage) reads a few such rows per page, the rerank reads them all.
"""

from __future__ import annotations

import torch
from freekv_kernels.page_select.naive import in_phase

CODE_BITS = 2
LEVELS = 1 << CODE_BITS
PER_BYTE = 8 // CODE_BITS


def empty_codes(num_pages: int, heads: int, page_size: int, head_dim: int, device=None) -> torch.Tensor:
    """A zeroed code store [num_pages, heads, page_size, head_dim / 4] uint8 in the byte-major layout."""
    return torch.zeros(num_pages, heads, head_dim // PER_BYTE, page_size, dtype=torch.uint8,
                       device=device).transpose(2, 3)


def quantize_keys(k: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """k [..., rows, D] with its page's lo / hi [..., D] -> codes [..., rows, D / 4] uint8."""
    lo, hi = lo.float().unsqueeze(-2), hi.float().unsqueeze(-2)
    span, x = hi - lo, 4.0 * (k.float() - lo)
    c = sum((x >= i * span).int() for i in range(1, LEVELS)) * (span > 0)
    shifts = torch.arange(PER_BYTE, device=k.device) * CODE_BITS
    return (c.unflatten(-1, (-1, PER_BYTE)) << shifts).sum(-1).to(torch.uint8)


def dequantize_keys(codes: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """codes [..., rows, D / 4] -> fp32 keys [..., rows, D] at their bins' centres: c * step + (lo + step / 2),
    step = (hi - lo) / 4 (the rerank kernel's arithmetic)."""
    shifts = torch.arange(PER_BYTE, device=codes.device) * CODE_BITS
    c = ((codes.to(torch.int32).unsqueeze(-1) >> shifts) & (LEVELS - 1)).flatten(-2).float()
    lo, hi = lo.float().unsqueeze(-2), hi.float().unsqueeze(-2)
    step = (hi - lo) / LEVELS
    return c * step + (lo + step * 0.5)


def sketch_bytes(q: torch.Tensor, nbytes: int) -> torch.Tensor:
    """[H, nbytes] the code bytes a KV head's sketch reads for query heads q [H, G, D]: the bytes (4 channels each)
    with the largest sum of |q| over their channels and the group, largest first, ties by the lower byte."""
    w = q.float().abs().unflatten(-1, (-1, PER_BYTE)).sum((1, 3))  # [H, D / 4]
    return torch.sort(w, dim=-1, descending=True, stable=True).indices[:, :nbytes]


def naive_sketch_picks(q: torch.Tensor, group: int, nbytes: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The sketch's picks of queries q [B, Hq, D]: sel [B, H, nbytes] int32 (sketch_bytes per KV head) and
    qp [B, H, 4 * nbytes, GP] fp32, the scaled query of head g of the group on channel 4 sel[r] + i at [4 r + i, g],
    rounded to fp16 (0 for the padding heads g >= G, GP = the next power of 2; channel-major so that a channel's
    heads are one vector load)."""
    B, Hq, D = q.shape
    H, GP = Hq // group, 1 << (group - 1).bit_length()
    qh = q.float().view(B, H, group, D)
    sel = torch.stack([sketch_bytes(qh[b], nbytes) for b in range(B)]).int()  # [B, H, nbytes]
    ch = (sel.long()[..., None] * PER_BYTE + torch.arange(PER_BYTE, device=q.device)).flatten(-2)  # [B, H, 4 nb]
    qp = torch.zeros(B, H, ch.shape[-1], GP, dtype=torch.float32, device=q.device)
    picked = qh.gather(-1, ch[:, :, None, :].expand(-1, -1, group, -1))  # [B, H, G, 4 nb]
    qp[..., :group] = (picked * scale).half().float().transpose(2, 3)
    return sel, qp


def naive_sketch_pages(
    q: torch.Tensor,
    summaries: torch.Tensor,
    codes: torch.Tensor,
    page_table: torch.Tensor,
    req_slots: torch.Tensor,
    scale: float,
    nbytes: int,
    heads: torch.Tensor | None = None,
    phase: int = 1,
    q_by_slot: bool = False,
    cand_start: int = 0,
    cand_end: torch.Tensor | None = None,
    picks: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The first stage's scores [B, H, M] of every page in [cand_start, cand_end[b]): as naive_rerank_pages (per query
    head the log-sum-exp of the page's logits, softmax over the pages, group mean), but a key is its page's
    mid-range (lo + hi) / 2 except on the 4 * nbytes channels of the sketch_bytes of the group's query, which
    decode from their codes; -inf at every other page. Rows of heads outside `phase` stay unwritten (NaN).
    A logit is computed as the kernel rounds it: (q . lo + q . hi) / 2 with lo, hi and the scaled query in fp16 (a
    tensor-core product), plus, on the picked channels, the fp16 scaled query times step * (code - 1.5) in fp32.
    picks: (sel, qp) of naive_sketch_picks by request slot (as query_similarity writes them) instead of the
    kernel's own; they must be this query's (checked)."""
    if picks is not None:
        G = q.shape[1] // summaries.shape[1]
        slots = req_slots.long()
        want = naive_sketch_picks(q[slots] if q_by_slot else q, G, nbytes, scale)
        mine = in_phase(heads, phase)
        mine = torch.ones(want[0].shape[:2], dtype=torch.bool, device=q.device) if mine is None else mine.clone()
        # Padding rows share one slot (the last one's picks stay there): their scores are never used.
        mine &= (slots[:, None] == slots[None, :]).sum(1)[:, None] == 1
        for got, ref in zip(picks, want):
            if not torch.equal(got[slots][mine], ref[mine]):
                raise ValueError("picks are not this query's sketch picks")

    def page_logits(qh: torch.Tensor, h: int, pages: torch.Tensor) -> torch.Tensor:
        sel = sketch_bytes(qh[None], nbytes)[0]
        ch = (sel[:, None] * PER_BYTE + torch.arange(PER_BYTE, device=q.device)).flatten()
        q16 = (qh * scale).half().float()  # [G, D]
        lo, hi = summaries[pages, h, 0], summaries[pages, h, 1]
        base = (lo.half().float() @ q16.T + hi.half().float() @ q16.T) * 0.5  # [n, G]
        step = (hi[..., ch].float() - lo[..., ch].float()) / LEVELS  # [n, R]
        shifts = torch.arange(PER_BYTE, device=q.device).repeat(nbytes) * CODE_BITS
        code = ((codes[pages, h][..., sel.repeat_interleave(PER_BYTE)].int() >> shifts) & (LEVELS - 1)).float()
        dev = (code - (LEVELS - 1) * 0.5) * step[:, None, :]  # [n, p, R]
        return base.T[:, :, None] + torch.einsum("gr,ntr->gnt", q16[:, ch], dev)

    return page_mass_scores(q, summaries.shape[1], page_table, req_slots, None, heads, phase, q_by_slot, cand_start,
                            cand_end, page_logits)


def naive_top_pages(
    scores: torch.Tensor,
    num: int,
    heads: torch.Tensor | None = None,
    phase: int = 1,
) -> torch.Tensor:
    """[B, H, num] int32: the num best pages of each row of scores [B, H, M], best first, ties by the lower page;
    -1 where the score is -inf or the row has fewer pages. Rows of heads outside `phase` stay unwritten."""
    mine = in_phase(heads, phase)
    B, H, M = scores.shape
    out = torch.full((B, H, num), -(2**30) + 7, dtype=torch.int32, device=scores.device)
    vals, idx = torch.sort(scores.float(), dim=-1, descending=True, stable=True)
    top = torch.where(vals[..., :num] == float("-inf"), -1, idx[..., :num]).int()
    if num > M:
        top = torch.cat([top, top.new_full((B, H, num - M), -1)], dim=-1)
    for b in range(B):
        for h in range(H):
            if mine is None or mine[b, h]:
                out[b, h] = top[b, h]
    return out


def naive_rerank_pages(
    q: torch.Tensor,
    summaries: torch.Tensor,
    codes: torch.Tensor,
    page_table: torch.Tensor,
    req_slots: torch.Tensor,
    cand: torch.Tensor | None,
    scale: float,
    heads: torch.Tensor | None = None,
    phase: int = 1,
    q_by_slot: bool = False,
    cand_start: int = 0,
    cand_end: torch.Tensor | None = None,
) -> torch.Tensor:
    """scores [B, H, M] for the candidate pages cand [B, H, C] (logical pages, -1 none) of each (row, KV head), or
    with cand None every page in [cand_start, cand_end[b]) (the full scan):
    per query head, the log-sum-exp of the page's decoded-key logits (keys and scaled query rounded to fp16), a
    softmax over the row's candidates, the mean over the group; -inf at every other page. Rows of heads outside
    `phase` stay unwritten (NaN)."""

    def page_logits(qh: torch.Tensor, h: int, pages: torch.Tensor) -> torch.Tensor:
        keys = dequantize_keys(codes[pages, h], summaries[pages, h, 0], summaries[pages, h, 1])  # [n, p, D]
        # The tensor-core product's operands: fp16 keys, fp16 scaled queries, fp32 sums.
        return torch.einsum("gd,ntd->gnt", (qh * scale).half().float(), keys.half().float())

    return page_mass_scores(q, summaries.shape[1], page_table, req_slots, cand, heads, phase, q_by_slot, cand_start,
                            cand_end, page_logits)


def page_mass_scores(q, num_kv_heads, page_table, req_slots, cand, heads, phase, q_by_slot, cand_start, cand_end,
                     page_logits) -> torch.Tensor:
    """The pooling the page-mass references share (these and channel_sketch's): for each (row, KV head) of the phase, the candidate pages (cand, or every
    page in [cand_start, cand_end[b])), page_logits(q of the head's group [G, D] fp32, h, host pages) -> [G, n, p],
    per query head the log-sum-exp over each page's tokens, softmax over the pages, mean over the group; -inf at
    every other page; rows of other heads NaN."""
    mine = in_phase(heads, phase)
    B, H, M = req_slots.shape[0], num_kv_heads, page_table.shape[1]
    G = q.shape[1] // H
    scores = torch.full((B, H, M), float("nan"), dtype=torch.float32, device=q.device)
    for b, slot in enumerate(req_slots.tolist()):
        qb = q[slot if q_by_slot else b].float().view(H, G, -1)
        for h in range(H):
            if mine is not None and not mine[b, h]:
                continue
            scores[b, h] = float("-inf")
            if cand is None:
                logical = torch.arange(cand_start, max(cand_start, min(int(cand_end[b]), M)), device=q.device)
            else:
                logical = cand[b, h][cand[b, h] >= 0].long()
            if logical.numel() == 0:
                continue
            s = page_logits(qb[h], h, page_table[slot, logical].long())
            scores[b, h, logical] = torch.softmax(torch.logsumexp(s, dim=-1), dim=-1).mean(0)
    return scores
