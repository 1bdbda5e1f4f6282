"""unit_page_scores (LouisKV's scoring of clusters and segments as page scores) against its torch reference."""

import math

import pytest
import torch

from freekv_kernels.page_select import PHASE_LATER, PHASE_NOW
from freekv_kernels.testing import assert_close, device, poisoned_outputs
from freekv_kernels.unit_scores import naive_unit_page_scores, unit_page_scores
from freekv_kernels.unit_scores.triton import CHUNK, PAGES

DEV = device()
R, M, SINK = 5, 12, 1


def make_tables(H, D, p, upp, dtype, P=40, M=M, ends=(12, 1, 7, 5, 0)):
    """Requests own random host pages; each head's candidate tokens are cut into contiguous units at random points
    (some pages hold many units, some units span pages); rows past a request's units are empty but hold garbage."""
    page_table = torch.full((R, M), -1, dtype=torch.int32)
    hosts = torch.randperm(P).to(torch.int32)
    cand_end = torch.tensor(ends, dtype=torch.int32)  # by default a full row, none, some, ...
    centroids = torch.randn(P * upp, H, D) * 3
    counts = torch.randint(1, 9, (P * upp, H), dtype=torch.int32)  # garbage in rows no request's units use
    ranges = torch.randint(0, 5, (P, H, 2), dtype=torch.int32)
    used = 0
    for r in range(R):
        n_pages = max(int(cand_end[r]) - SINK, 0)
        page_table[r, SINK:SINK + n_pages] = hosts[used:used + n_pages]
        used += n_pages
        if not n_pages:
            continue
        N = n_pages * p
        u = torch.arange(n_pages * upp)
        rows = page_table[r, SINK + u // upp].long() * upp + u % upp
        for h in range(H):
            n_units = int(torch.randint(1, n_pages * upp + 1, ()))
            cuts = torch.sort(torch.randperm(N - 1)[:n_units - 1] + 1).values
            unit_of = torch.zeros(N, dtype=torch.int64)
            unit_of[cuts] = 1
            unit_of = unit_of.cumsum(0)  # [N]: ordinal of each token
            sizes = torch.bincount(unit_of, minlength=n_pages * upp)
            counts[rows, h] = sizes.int()
            hp = page_table[r, SINK:SINK + n_pages].long()
            ranges[hp, h, 0] = unit_of[::p].int()
            ranges[hp, h, 1] = unit_of[p - 1::p].int()
    return [t.to(DEV) for t in (centroids.to(dtype), counts, ranges, page_table, cand_end)]


@pytest.mark.parametrize("p,upp", [(16, 1), (32, 2), (16, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("G,D", [(1, 64), (3, 32), (4, 16), (8, 128)])
def test_unit_page_scores_match_reference(G, D, dtype, p, upp):
    H = 2
    centroids, counts, ranges, page_table, cand_end = make_tables(H, D, p, upp, dtype)
    B = 4
    req_slots = torch.tensor([2, 0, 3, 1], dtype=torch.int32, device=DEV)
    q = torch.randn(B, H * G, D, device=DEV).to(dtype)
    heads = torch.rand(B, H, device=DEV) < 0.7
    heads[0] = True
    for phase in (PHASE_NOW, PHASE_LATER):
        args = (q, centroids, counts, ranges, page_table, req_slots, SINK, cand_end[req_slots.long()],
                1 / math.sqrt(D), p, heads, phase)
        ref = naive_unit_page_scores(*args)
        with poisoned_outputs():
            out = unit_page_scores(*args)
        mine = heads if phase == PHASE_NOW else ~heads
        assert_close("scores", ref[mine], out[mine], atol=1e-6, rtol=1e-4)
        assert out[mine].isfinite().any(-1).tolist() == (cand_end[req_slots.long()] > SINK)[mine.nonzero()[:, 0]] \
            .tolist(), "a row with candidates must score some page"


@pytest.mark.parametrize("G", [1, 3, 4, 8])
def test_long_rows_span_chunks_and_page_blocks(G):
    """Rows of many units: the softmax partials of several chunks merge into one normaliser, and pages score in
    several blocks (the kernels split a row at CHUNK units and PAGES pages)."""
    H, D, p, upp, M_LONG = 2, 32, 16, 2, 3 * CHUNK // 2 + 5
    centroids, counts, ranges, page_table, cand_end = make_tables(H, D, p, upp, torch.float32, P=5 * M_LONG,
                                                                  M=M_LONG, ends=(M_LONG, 3, M_LONG - 17, 90, 0))
    req_slots = torch.tensor([0, 2, 3, 4, 1], dtype=torch.int32, device=DEV)
    q = torch.randn(5, H * G, D, device=DEV)
    heads = torch.ones(5, H, dtype=torch.bool, device=DEV)
    args = (q, centroids, counts, ranges, page_table, req_slots, SINK, cand_end[req_slots.long()], 1 / math.sqrt(D),
            p, heads, PHASE_NOW)
    assert -(-M_LONG * upp // CHUNK) > 2 and M_LONG > 8 * PAGES
    with poisoned_outputs():
        out = unit_page_scores(*args)
    assert_close("scores", naive_unit_page_scores(*args), out, atol=1e-7, rtol=1e-4)


def test_scores_are_group_mean_softmax_over_units():
    """Two pages, units 0 | 1 2 | 2 (unit 2 spans pages 2-3): each page scores its best unit's group-mean
    probability; empty units (count 0) take no share of the softmax."""
    H, G, D, p = 1, 2, 16, 16
    centroids = torch.zeros(4, H, D)
    centroids[:3, 0, 0] = torch.tensor([1.0, 2.0, 3.0])
    centroids[3, 0, 0] = 100.0  # an empty unit: must not count
    counts = torch.tensor([[8], [8], [16], [0]], dtype=torch.int32)
    page_table = torch.tensor([[-1, 0, 1, 2]], dtype=torch.int32)
    ranges = torch.tensor([[[0, 1]], [[2, 2]], [[2, 2]], [[3, 3]]], dtype=torch.int32)
    q = torch.zeros(1, G, D)
    q[0, 0, 0], q[0, 1, 0] = 1.0, -1.0
    heads = torch.ones(1, H, dtype=torch.bool)
    cand_end = torch.tensor([4], dtype=torch.int32)
    args = [t.to(DEV) for t in (q, centroids, counts, ranges, page_table, torch.tensor([0], dtype=torch.int32))]
    out = unit_page_scores(*args, 1, cand_end.to(DEV), 1.0, p, heads.to(DEV)).cpu()
    logits = torch.tensor([[1.0, 2.0, 3.0], [-1.0, -2.0, -3.0]])
    a = torch.softmax(logits, -1).mean(0)
    torch.testing.assert_close(out[0, 0], torch.tensor([float("-inf"), a[:2].max(), a[2], a[2]]))
