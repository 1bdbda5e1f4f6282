"""semantic_boundary (LouisKV's trigger) against its torch reference, and the trigger's semantics."""

import pytest
import torch

from freekv_kernels.semantic_boundary import naive_semantic_boundary, semantic_boundary
from freekv_kernels.testing import assert_close, device, poisoned_outputs

B, H, R, M, K = 5, 3, 8, 40, 4
DEV = device()


def make_inputs(G, D, dtype, p):
    """Rows close to, far from or opposite to their previous query; prev_q rows outside the batch are NaN."""
    Hq = H * G
    prev_q = torch.full((R, Hq, D), float("nan"))
    req_slots = torch.randperm(R)[:B].to(torch.int32)
    prev = torch.randn(B, Hq, D)
    prev_q[req_slots.long()] = prev
    a = torch.tensor([0.95, 0.1, 0.8, -0.9, 0.5])[:, None, None]  # mean cosines spread around tau
    q = a * prev + (1 - a.abs()) * torch.randn(B, Hq, D) * 0.5
    has_prev = torch.rand(R) < 0.7
    has_prev[req_slots[1]] = False  # a new request
    has_prev[req_slots[0]] = True
    lens = torch.randint(1, M * p, (B,), dtype=torch.int32)
    slots = torch.randint(-1, 9, (R, H, K), dtype=torch.int32)
    n_slots = torch.randint(0, K + 1, (B,), dtype=torch.int32)
    marks = (torch.rand(R, M) < 0.2).to(torch.int8)
    return [t.to(DEV) for t in (q.to(dtype), prev_q.to(dtype), req_slots, has_prev, lens, marks, slots, n_slots)]


def run_both(q, prev_q, req_slots, has_prev, lens, marks, slots, n_slots, tau, p, pad_slot=-1):
    ref_state = [prev_q.clone(), has_prev.clone(), marks.clone()]
    heads_ref = torch.full((B, H), True, device=DEV)
    stats_ref = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64, device=DEV)
    stats = stats_ref.clone()
    fired_ref = naive_semantic_boundary(q, ref_state[0], req_slots, ref_state[1], tau, lens, p, ref_state[2], slots,
                                        n_slots, heads_ref, stats_ref, pad_slot)
    heads = torch.zeros(B, H, dtype=torch.bool, device=DEV)
    with poisoned_outputs():
        fired = semantic_boundary(q, prev_q, req_slots, has_prev, tau, lens, p, marks, slots, n_slots, heads, stats,
                                  pad_slot)
    assert_close("fired", fired_ref, fired)
    assert_close("heads", heads_ref, heads)
    assert_close("marks", ref_state[2], marks)
    torch.testing.assert_close(stats, stats_ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(prev_q.isnan(), ref_state[0].isnan()), "prev_q rows outside the batch were written"
    assert_close("prev_q", ref_state[0].nan_to_num(), prev_q.nan_to_num())
    assert_close("has_prev", ref_state[1], has_prev)
    return fired, heads


@pytest.mark.parametrize("p", [16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("G,D", [(1, 64), (3, 32), (4, 16), (8, 128)])
def test_semantic_boundary_matches_reference(G, D, dtype, p):
    inputs = make_inputs(G, D, dtype, p)
    q, prev_q, req_slots = inputs[:3]
    r_t = torch.nn.functional.cosine_similarity(q.float(), prev_q[req_slots.long()].float(), dim=-1).mean(-1)
    assert (r_t - 0.6).abs().min() > 1e-3  # no row within rounding of tau
    run_both(*inputs, tau=0.6, p=p, pad_slot=int(req_slots[4]))


def test_boundary_is_one_mean_over_every_query_head():
    """The paper's r_t averages all query heads: one KV head's group turning away does not fire a row whose other
    groups hold (a per-KV-head trigger would), and every KV head of a firing row selects."""
    G, D, p = 2, 16, 16
    q, prev_q, req_slots, has_prev, lens, marks, slots, n_slots = make_inputs(G, D, torch.float32, p)
    has_prev[:] = True
    prev = prev_q[req_slots.long()]
    q = prev.clone()
    q[0, :G] = -prev[0, :G]  # row 0: KV head 0's group reversed, r_t = (H - 2) / H
    q[1] = -prev[1]  # row 1: every head reversed
    slots.fill_(0)  # every head holds K pages, n_slots <= K: nothing to fill
    marks.zero_()
    fired, heads = run_both(q, prev_q, req_slots, has_prev, lens, marks, slots, n_slots, tau=0.3, p=p)
    assert fired.tolist() == [False, True, False, False, False]
    assert heads[1].all() and not heads[0].any()
    assert marks[req_slots[1].long(), (lens[1].long() - 1) // p] == 1 and int(marks.sum()) == 1
    assert (prev_q[req_slots.long()] == q).all()


@pytest.mark.parametrize("tau", [0.0, 1.0])
def test_tau_bounds_and_empty_slots(tau):
    """tau 0 fires only rows without a previous query, tau 1 every row; a head holding fewer pages than its row's
    n_slots selects (fills) without a boundary."""
    q, prev_q, req_slots, has_prev, lens, marks, slots, n_slots = make_inputs(3, 32, torch.float32, 16)
    has_prev[req_slots[[0, 2, 3, 4]].long()] = True
    slots.fill_(-1)
    n_slots.fill_(1)
    n_slots[3] = 0
    fired, heads = run_both(q, prev_q, req_slots, has_prev, lens, marks, slots, n_slots, tau=tau, p=16)
    want = [True] * B if tau == 1 else [False, True, False, False, False]
    assert fired.tolist() == want
    assert heads.all(1).tolist() == [f or b != 3 for b, f in enumerate(want)]
