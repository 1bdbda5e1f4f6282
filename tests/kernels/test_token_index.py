"""head_token_index against its torch reference: every listed entry right, nothing else written."""

import pytest
import torch

from freekv_kernels.testing import device
from freekv_kernels.token_index import head_token_index, naive_head_token_index

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
