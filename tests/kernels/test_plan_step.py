"""plan_step against its torch reference: every output of the given rows right, nothing else written."""

import pytest
import torch

from freekv_kernels.plan_step import naive_plan_step, plan_step
from freekv_kernels.testing import device

DEV = device()
SENTINEL = -(2**30) + 7
DENSE = ("dense_loc", "dense_table", "dense_pages")


def outputs(B, W, K, M, dev, poison):
    """Every output over B + 2 rows (the last two must stay untouched); ints hold SENTINEL, bools the byte 7."""
    def make(*cols, dtype=torch.int32):
        t = torch.zeros(B + 2, *cols, dtype=dtype, device=dev)
        if poison:
            (t.view(torch.uint8) if dtype == torch.bool else t).fill_(7 if dtype == torch.bool else SENTINEL)
        return t

    return dict(sparse_loc=make(dtype=torch.int64), row_table=make(W), row_pages=make(), row_tokens=make(),
                row_start=make(), n_sink=make(), n_slots=make(), last_page_len=make(), cand_end=make(),
                slot_pages=make(K), offload_src=make(), offload_dst=make(), offload_valid=make(dtype=torch.bool),
                dense_loc=make(dtype=torch.int64), dense_table=make(M), dense_pages=make())


def lengths(B, p, n_s, k, n_w, M, g):
    """Row lengths cycling through: inside the sink, inside the window, exactly on a page boundary (the step
    after which a page is offloaded), far past the budget, and the longest a request can be."""
    kinds = [lambda: torch.randint(1, max(n_s * p, 1) + 1, (), generator=g),
             lambda: torch.randint(n_s * p + 1, (n_s + n_w + 1) * p + 1, (), generator=g),
             lambda: p * torch.randint(1, M + 1, (), generator=g),
             lambda: torch.randint((n_s + k + n_w + 2) * p, M * p + 1, (), generator=g),
             lambda: torch.tensor(M * p)]
    return torch.stack([kinds[i % len(kinds)]() for i in torch.randperm(B, generator=g).tolist()]).int()


# (B, page size, sink / budget / window pages, max pages, retrieval, dense outputs); B = 300 spans several
# programs and more earlier rows than one iteration of the prefix sum covers.
CASES = [(1, 16, (1, 3, 2), 40, True, True), (3, 32, (2, 2, 1), 40, False, True),
         (37, 16, (0, 4, 2), 150, True, True), (37, 32, (1, 3, 2), 40, True, False),
         (37, 16, (2, 1, 3), 40, False, False), (300, 16, (1, 2, 2), 24, True, False)]


@pytest.mark.parametrize("B,p,pages,M,retrieval,dense", CASES)
def test_plan_step_matches_reference(B, p, pages, M, retrieval, dense):
    n_s, k, n_w = pages
    W, R, pad = n_s + k + n_w + 1, B + 5, 2
    g = torch.Generator().manual_seed(B * 1000 + p * 10 + n_s)
    req = torch.randperm(R, generator=g)[:B].int()
    lens = lengths(B, p, n_s, k, n_w, M, g)
    # Padding rows (the pad slot, any length: one on a page boundary must not offload).
    req[1::4] = pad
    lens[req == pad] = torch.tensor([1, p * (n_s + n_w + 2)], dtype=torch.int32).repeat(B)[:int((req == pad).sum())]
    page_table = torch.randint(0, 10**6, (R, M), generator=g, dtype=torch.int32)

    want = outputs(B, W, K=k, M=M, dev="cpu", poison=False)
    naive_plan_step(req, lens, page_table, p, n_s, n_w, pad, retrieval, **{name: t[:B] for name, t in want.items()})
    got = outputs(B, W, K=k, M=M, dev=DEV, poison=True)
    given = {name: t[:B] for name, t in got.items() if dense or name not in DENSE}
    plan_step(req.to(DEV), lens.to(DEV), page_table.to(DEV), p, n_s, n_w, pad, retrieval, **given)

    for name, t in got.items():
        t = (t.view(torch.uint8) if t.dtype == torch.bool else t).cpu()
        if name in DENSE and not dense:
            assert (t == SENTINEL).all(), f"{name} written though not requested"
            continue
        ref = want[name].view(torch.uint8) if t.dtype == torch.uint8 else want[name]
        assert torch.equal(t[:B], ref[:B]), f"{name}: {int((t[:B] != ref[:B]).sum())} entries differ"
        assert (t[B:] == (7 if name == "offload_valid" else SENTINEL)).all(), f"{name} written past row {B}"

    # The contract on the reference itself: row_start is the exclusive prefix sum of row_tokens; a page leaves the
    # window exactly on a page boundary past the sink and the window, never from a padding row.
    tokens = want["row_tokens"][:B]
    assert torch.equal(want["row_start"][:B], (tokens.cumsum(0) - tokens).int())
    leaving = lens // p - n_w - 1
    valid = (lens % p == 0) & (leaving >= n_s) & (req != pad)
    assert torch.equal(want["offload_valid"][:B], valid) and (valid.any() or B == 1)
    assert torch.equal(want["offload_dst"][:B][valid], page_table[req[valid].long(), leaving[valid].long()])
