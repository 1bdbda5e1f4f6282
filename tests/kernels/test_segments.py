"""segment_pages (LouisKV's temporal segments) against its torch reference, and how segments form over steps."""

import pytest
import torch

from freekv_kernels.segments import naive_segment_pages, segment_pages
from freekv_kernels.testing import device

DEV = device()
R, M, SINK, WIN = 4, 30, 1, 2


def make_state(H, D, p, upp, dtype, P=50):
    k_cache = torch.randn(20 * p, H, D).to(dtype)
    marks = (torch.rand(R, M) < 0.3).to(torch.int8)
    seg_sum = torch.randn(R, H, D)
    seg_len = torch.randint(1, 5, (R, H), dtype=torch.int32) * p
    # Open segments in distinct rows of pages no test offloads to (pages 20-39), some requests with none.
    seg_row = ((20 + torch.randperm(20)[:R * H]) * upp).view(R, H).int()
    seg_row[torch.rand(R, H) < 0.25] = -1
    seg_ord = torch.randint(0, 9, (R, H), dtype=torch.int32)
    centroids = torch.full((P * upp, H, D), float("nan")).to(dtype)  # untouched rows must stay NaN
    counts = torch.full((P * upp, H), -7, dtype=torch.int32)
    ranges = torch.full((P, H, 2), -7, dtype=torch.int32)
    return [t.to(DEV) for t in (k_cache, marks, seg_sum, seg_len, seg_row, seg_ord, centroids, counts, ranges)]


@pytest.mark.parametrize("p,upp", [(16, 1), (32, 2), (16, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H,D", [(1, 64), (3, 32), (2, 16)])
def test_segment_pages_matches_reference(H, D, p, upp, dtype):
    state = make_state(H, D, p, upp, dtype)
    B = 4
    req_slots = torch.tensor([3, 0, 2, 1], dtype=torch.int32, device=DEV)
    lens = torch.tensor([10 * p, 6 * p, 17 * p + 3, 4 * p], dtype=torch.int32, device=DEV)
    valid = torch.tensor([True, True, False, True], device=DEV)
    src = torch.tensor([3, 7, 0, 12], dtype=torch.int32, device=DEV)
    dst = torch.tensor([44, 2, 0, 17], dtype=torch.int32, device=DEV)
    ref = [t.clone() for t in state]
    args = (lens, req_slots, src, dst, valid)
    naive_segment_pages(ref[0], *args, *ref[1:], p, SINK, WIN, 3 * p)
    segment_pages(state[0], *args, *state[1:], p, SINK, WIN, 3 * p)
    for name, a, b in zip(["marks", "seg_sum", "seg_len", "seg_row", "seg_ord", "centroids", "counts", "ranges"],
                          ref[1:], state[1:]):
        assert torch.equal(a.isnan(), b.isnan()) if a.is_floating_point() else True, name
        torch.testing.assert_close(b.nan_to_num(), a.nan_to_num(), atol=1e-5, rtol=1e-2 if dtype != torch.float32
                                   else 1e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_segments_form_at_boundaries_and_at_the_cap(backend):
    """Pages leaving the window one per step: page 0 opens a segment, pages 1-2 join it, page 3 would exceed the
    cap of 3 pages and opens one, page 4 saw a boundary and opens one; centroids are the mean keys so far."""
    fn = segment_pages if backend == "triton" else naive_segment_pages
    H, D, p, upp = 1, 16, 16, 2
    k_cache, marks, seg_sum, seg_len, seg_row, seg_ord, centroids, counts, ranges = make_state(H, D, p, upp,
                                                                                              torch.float32)
    marks.zero_()
    seg_row.fill_(-1)
    marks[0, SINK + 4] = 1
    one = lambda x, dt=torch.int32: torch.tensor([x], dtype=dt, device=DEV)  # noqa: E731
    leaving = []
    for i in range(5):
        j = SINK + i  # the page leaving the window
        n = (j + WIN + 1) * p  # the step whose token fills page j + WIN
        fn(k_cache, one(n), one(0), one(i), one(10 + i), one(True, torch.bool), marks, seg_sum, seg_len, seg_row,
           seg_ord, centroids, counts, ranges, p, SINK, WIN, 3 * p)
        leaving.append(k_cache[i * p:(i + 1) * p, 0].float())
    assert ranges[10:15, 0, 0].tolist() == [0, 0, 0, 3 * upp, 4 * upp]
    assert (ranges[10:15, 0, 0] == ranges[10:15, 0, 1]).all()
    starts = {10: [0, 1, 2], 13: [3], 14: [4]}  # host page of each segment's row -> its pages
    for hp, pages in starts.items():
        assert counts[hp * upp, 0] == len(pages) * p and counts[hp * upp + 1, 0] == 0
        want = torch.cat([leaving[i] for i in pages]).mean(0)
        torch.testing.assert_close(centroids[hp * upp, 0], want, atol=1e-5, rtol=1e-5)
    assert counts[11 * upp:13 * upp, 0].eq(0).all()
