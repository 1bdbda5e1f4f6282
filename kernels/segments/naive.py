"""Torch reference for segment_pages (see docs/kernels.md).

Per request and KV head one segment is open at a time: its unit-table row, ordinal, token count and the fp32 sum of
its keys. A page leaving the window (the step's offload) starts a new segment when a semantic boundary fired at one
of its tokens (marks), when none is open, or when it would make the open one longer than max_tokens; otherwise it
joins the open one. Segments are whole pages: a boundary inside a page starts the segment at the page's first token.
"""

from __future__ import annotations

import torch


def naive_segment_pages(
    k_cache: torch.Tensor,
    lens: torch.Tensor,
    req_slots: torch.Tensor,
    offload_src: torch.Tensor,
    offload_dst: torch.Tensor,
    offload_valid: torch.Tensor,
    marks: torch.Tensor,
    seg_sum: torch.Tensor,
    seg_len: torch.Tensor,
    seg_row: torch.Tensor,
    seg_ord: torch.Tensor,
    centroids: torch.Tensor,
    counts: torch.Tensor,
    ranges: torch.Tensor,
    page_size: int,
    sink_pages: int,
    window_pages: int,
    max_tokens: int,
) -> None:
    """For each row b with offload_valid[b] (request r, leaving page j = lens[b] // p - window_pages - 1 in GPU page
    offload_src[b], host page hp = offload_dst[b]) and head h: a new segment takes ordinal (j - sink_pages) * upp and
    row hp * upp; the segment's centroid row gets the mean of its keys so far and its token count; hp's other rows
    get count 0; ranges[hp, h] = (ordinal, ordinal); the open-segment state of (r, h) is updated."""
    p, upp = page_size, centroids.shape[0] // ranges.shape[0]
    for b in torch.nonzero(offload_valid).flatten().tolist():
        r, hp, src = int(req_slots[b]), int(offload_dst[b]), int(offload_src[b])
        j = int(lens[b]) // p - window_pages - 1
        page_sum = k_cache[src * p:(src + 1) * p].float().sum(0)  # [H, D]
        for h in range(k_cache.shape[1]):
            new = bool(marks[r, j]) or int(seg_row[r, h]) < 0 or int(seg_len[r, h]) + p > max_tokens
            if new:
                row, ordinal, total, n = hp * upp, (j - sink_pages) * upp, page_sum[h], p
            else:
                row, ordinal = int(seg_row[r, h]), int(seg_ord[r, h])
                total, n = seg_sum[r, h] + page_sum[h], int(seg_len[r, h]) + p
            counts[hp * upp:(hp + 1) * upp, h] = 0
            centroids[row, h] = (total / n).to(centroids.dtype)
            counts[row, h] = n
            ranges[hp, h] = ordinal
            seg_sum[r, h], seg_len[r, h], seg_row[r, h], seg_ord[r, h] = total, n, row, ordinal
