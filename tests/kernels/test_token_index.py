"""head_pages and head_token_index against their torch references: every entry right, nothing else written."""

import pytest
import torch

from freekv_kernels.testing import assert_close, device, poisoned_outputs
from freekv_kernels.token_index import head_pages, head_token_index, naive_head_pages, naive_head_token_index

DEV = device()
SENTINEL = -(2**30) + 7


@pytest.mark.parametrize("p", [16, 32])
@pytest.mark.parametrize("B,H,rp", [(1, 1, 1), (3, 3, 5), (4, 8, 13), (5, 2, 9)])
def test_head_token_index_matches_reference(B, H, rp, p):
    g = torch.Generator().manual_seed(B * 100 + H * 10 + rp + p)
    pages = torch.randint(0, 1000, (B, H, rp), generator=g, dtype=torch.int32)
    # Lengths from one token to every page full, with a partial last page.
    tokens = torch.randint(1, rp * p + 1, (B,), generator=g, dtype=torch.int32)
    tokens[0] = rp * p
    start = (torch.cumsum(tokens, 0) - tokens).int()
    total = int(tokens.sum()) * H
    # Padding after the lists (and a guard) must stay untouched.
    want = torch.full((total + 37,), SENTINEL, dtype=torch.int32)
    naive_head_token_index(pages, tokens, start, p, want)
    got = torch.full((total + 37,), SENTINEL, dtype=torch.int32, device=DEV)
    head_token_index(pages.to(DEV), tokens.to(DEV), start.to(DEV), p, got)
    assert torch.equal(got.cpu(), want)
    assert (want[:total] != SENTINEL).all() and (want[total:] == SENTINEL).all()
    # Spot-check the contract itself on the last (row, head).
    b, h = B - 1, H - 1
    n = int(tokens[b])
    o = H * int(start[b]) + h * n
    t = torch.arange(n)
    assert torch.equal(want[o:o + n], ((pages[b, h, t // p].long() * p + t % p) * H + h).int())


def test_head_token_index_of_a_strided_page_table():
    """head_pages may be a view (the engine passes a gathered, expanded tensor): strides are honoured."""
    B, H, rp, p = 2, 3, 4, 16
    base = torch.randint(0, 50, (B, rp), dtype=torch.int32)
    pages = base[:, None, :].expand(B, H, rp)
    tokens = torch.tensor([rp * p, 5], dtype=torch.int32)
    start = torch.tensor([0, rp * p], dtype=torch.int32)
    want = torch.full((int(tokens.sum()) * H,), SENTINEL, dtype=torch.int32)
    naive_head_token_index(pages, tokens, start, p, want)
    got = torch.full_like(want, SENTINEL, device=DEV)
    head_token_index(pages.to(DEV), tokens.to(DEV), start.to(DEV), p, got)
    assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("H,k,W", [(1, 1, 4), (1, 5, 9), (3, 4, 13), (8, 16, 23), (2, 37, 45)])
def test_head_pages_matches_reference(H, k, W):
    """Each head's slot pages in the order of the logical pages its slots hold (empty slots last), the rest of
    the row as row_table; every entry of [B, H, W] written (poisoned output), the inputs only read."""
    B, R = 5, 7
    g = torch.Generator().manual_seed(H * 1000 + k * 10 + W)
    req_slots = torch.randperm(R, generator=g)[:B].int()
    slots = torch.randint(-5, 10**6, (R, H, k), generator=g, dtype=torch.int32)  # rows outside the batch: garbage
    for r in req_slots.tolist():
        for h in range(H):
            slots[r, h] = torch.randperm(4 * k, generator=g)[:k].int()
            slots[r, h, torch.rand(k, generator=g) < 0.3] = -1
    n_sink = torch.randint(0, min(4, W - k) + 1, (B,), generator=g, dtype=torch.int32)
    n_slots = torch.randint(0, k + 1, (B,), generator=g, dtype=torch.int32)
    n_slots[0] = k
    row_table = torch.randint(0, 1000, (B, W), generator=g, dtype=torch.int32)
    slot_pages = torch.randperm(10 * B * k, generator=g)[:B * k].int().view(B, k)
    args = [t.to(DEV) for t in (slots, req_slots, row_table, n_sink, n_slots, slot_pages)]
    before = [t.clone() for t in args]
    ref = naive_head_pages(*args)
    with poisoned_outputs():
        out = head_pages(*args)
    assert_close("head_pages", ref, out)
    assert all(torch.equal(a, b) for a, b in zip(before, args)), "an input was modified"
    ref = ref.cpu()
    for b, r in enumerate(req_slots.tolist()):
        first, count = int(n_sink[b]), int(n_slots[b])
        where = {int(page): s for s, page in enumerate(slot_pages[b].tolist())}
        for h in range(H):
            row = ref[b, h].tolist()
            rest = row_table[b].tolist()
            assert row[:first] + row[first + count:] == rest[:first] + rest[first + count:]
            held = [int(slots[r, h, where[page]]) for page in row[first:first + count]]
            assert held == sorted(held, key=lambda x: (x < 0, x))
