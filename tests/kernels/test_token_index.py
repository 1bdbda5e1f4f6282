"""head_token_index against its torch reference: every listed token right, in logical page order, nothing else
written; with q, every (row, KV head)'s query rows."""

import pytest
import torch

from freekv_kernels.testing import device
from freekv_kernels.token_index import head_token_index, naive_head_token_index

DEV = device()
SENTINEL = -(2**30) + 7


def make_inputs(B, H, k, W, p, g):
    """A batch of B rows over R > B request slots, with strided row_table and slot_pages views."""
    R = B + 2
    req_slots = torch.randperm(R, generator=g)[:B].int()
    slots = torch.randint(-5, 10**6, (R, H, k), generator=g, dtype=torch.int32)  # rows outside the batch: garbage
    for r in req_slots.tolist():
        for h in range(H):
            slots[r, h] = torch.randperm(4 * k, generator=g)[:k].int()  # distinct logical pages
            slots[r, h, torch.rand(k, generator=g) < 0.3] = -1
    n_sink = torch.randint(0, min(4, W - k) + 1, (B,), generator=g, dtype=torch.int32)
    n_slots = torch.randint(0, k + 1, (B,), generator=g, dtype=torch.int32)
    n_slots[0] = k
    # From one token to every page full, with a partial last page; slot pages may lie past a short row's end.
    tokens = torch.randint(1, W * p + 1, (B,), generator=g, dtype=torch.int32)
    tokens[0] = W * p
    start = (torch.cumsum(tokens, 0) - tokens).int()
    row_table = torch.randint(0, 1000, (B, 2 * W), generator=g, dtype=torch.int32).to(DEV)[:, ::2]
    slot_pages = torch.randperm(10 * B * k, generator=g)[:B * k].int().view(k, B).to(DEV).t()
    return [slots.to(DEV), req_slots.to(DEV), row_table, n_sink.to(DEV), n_slots.to(DEV), slot_pages,
            tokens.to(DEV), start.to(DEV)]


@pytest.mark.parametrize("p", [16, 32])
@pytest.mark.parametrize("B,H,k,W", [(1, 1, 1, 4), (3, 3, 5, 9), (4, 8, 16, 23), (2, 2, 70, 78)])
def test_head_token_index_matches_reference(B, H, k, W, p):
    """Random slot tables with empty slots, ragged rows, GQA-like head counts, more slots than one rank tile; query
    rows of groups 1, 3, 4 and 8 (outputs poisoned with NaN)."""
    g = torch.Generator().manual_seed(B * 1000 + H * 100 + k + W + p)
    args = make_inputs(B, H, k, W, p, g)
    before = [t.clone() for t in args]
    total = int(args[6].sum()) * H
    # Padding after the lists (and a guard) must stay untouched.
    want = torch.full((total + 37,), SENTINEL, dtype=torch.int32)
    naive_head_token_index(*[t.cpu() for t in args], p, want)
    got = torch.full((total + 37,), SENTINEL, dtype=torch.int32, device=DEV)
    head_token_index(*args, p, got)
    assert torch.equal(got.cpu(), want)
    assert all(torch.equal(a, b) for a, b in zip(before, args)), "an input was modified"
    # With q: the same lists, and each (row, KV head)'s query rows, from a strided q as SGLang's QKV split gives.
    for G, D in ((1, 16), (3, 40), (4, 64), (8, 32)):
        qkv = torch.randn(B, (H * G + 2 * H) * D, generator=g).to(torch.bfloat16).to(DEV)
        q = qkv[:, :H * G * D].view(B, H * G, D)
        rows = torch.full((B * H, G, D), float("nan"), dtype=torch.bfloat16, device=DEV)
        got.fill_(SENTINEL)
        head_token_index(*args, p, got, q, rows)
        assert torch.equal(got.cpu(), want)
        want_rows = torch.full_like(rows, float("nan")).cpu()
        naive_head_token_index(*[t.cpu() for t in args], p, want.clone(), q.cpu(), want_rows)
        assert torch.equal(rows.cpu(), want_rows) and torch.equal(want_rows, q.cpu().reshape(B * H, G, D))
    assert (want[:total] != SENTINEL).all() and (want[total:] == SENTINEL).all()

    # The contract itself: whole pages, the selection in logical page order (empty slots last), the rest row_table.
    slots, req_slots, row_table, n_sink, n_slots, slot_pages, tokens, start = [t.cpu() for t in args]
    for b, r in enumerate(req_slots.tolist()):
        n, first, count = int(tokens[b]), int(n_sink[b]), int(n_slots[b])
        where = {int(page): s for s, page in enumerate(slot_pages[b].tolist())}
        for h in range(H):
            o = H * int(start[b]) + h * n
            rows = want[o:o + n].long()
            assert ((rows - h) % H == 0).all()
            t = torch.arange(n)
            pages = (rows - h) // H // p
            assert torch.equal((rows - h) // H % p, t % p) and torch.equal(pages, pages[t // p * p])
            pages = pages[::p].tolist()
            rest = row_table[b, :len(pages)].tolist()
            assert pages[:first] + pages[first + count:] == rest[:first] + rest[first + count:]
            held = [int(slots[r, h, where[page]]) for page in pages[first:first + count]]
            assert held == sorted(held, key=lambda x: (x < 0, x))


@pytest.mark.parametrize("p", [16, 32])
def test_every_page_selected_lists_the_context_in_order(p):
    """Every page between the sink and the window held by a slot, in a different slot order per head: each
    head's list reads the row's tokens in order, as full attention does."""
    H, k, first = 3, 6, 1
    W = first + k + 2
    n = (W - 1) * p + 5
    slots = torch.stack([torch.randperm(k) + first for _ in range(H)]).int()  # logical pages of head h's slots
    gpu = torch.arange(W, dtype=torch.int32)
    gpu[first:first + k] = 100 + torch.arange(k)  # sink and window on GPU pages 0.., slot s on page 100 + s
    args = [slots[None], torch.zeros(1, dtype=torch.int32), gpu[None], torch.tensor([first], dtype=torch.int32),
            torch.tensor([k], dtype=torch.int32), 100 + torch.arange(k, dtype=torch.int32)[None],
            torch.tensor([n], dtype=torch.int32), torch.zeros(1, dtype=torch.int32)]
    got = torch.full((n * H,), SENTINEL, dtype=torch.int32, device=DEV)
    head_token_index(*[t.to(DEV) for t in args], p, got)
    rows = got.cpu().view(H, n).long()
    h = torch.arange(H)[:, None]
    assert ((rows - h) % H == 0).all()
    page, offset = (rows - h) // H // p, (rows - h) // H % p
    logical = torch.where(page >= 100, slots.long().gather(1, (page - 100).clamp(0, k - 1)), page)
    assert torch.equal(logical * p + offset, torch.arange(n).expand(H, n))


def test_q_and_q_rows_come_together():
    args = make_inputs(1, 1, 1, 4, 16, torch.Generator().manual_seed(0))
    out = torch.zeros(64, dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="q and q_rows come together"):
        head_token_index(*args, 16, out, torch.zeros(1, 4, 8, device=DEV))
