"""query_similarity against its torch reference, plus the tau / has_prev semantics and the prev_q update."""

import pytest
import torch

from freekv_kernels.query_similarity import naive_query_similarity, query_similarity
from freekv_kernels.testing import assert_close, device, poisoned_outputs

B, H, R = 5, 3, 8


def make_inputs(G, D, dtype):
    """q close to, far from, or opposite to the previous query depending on the head; built on CPU.

    prev_q rows of requests outside the batch are NaN: they must be neither read nor written.
    """
    Hq = H * G
    prev_q = torch.full((R, Hq, D), float("nan"))
    req_slots = torch.randperm(R)[:B].to(torch.int32)
    prev = torch.randn(B, Hq, D)
    prev_q[req_slots.long()] = prev
    sign = torch.where(torch.rand(B, Hq, 1) < 0.2, -1.0, 1.0)
    noise = torch.rand(B, Hq, 1) * 2
    q = sign * prev + noise * torch.randn(B, Hq, D)
    has_prev = torch.rand(R) < 0.7
    has_prev[req_slots[1]] = False  # a new request: no previous query (its prev_q row is stale)
    has_prev[req_slots[2]] = True
    dev = device()
    return q.to(dtype).to(dev), prev_q.to(dtype).to(dev), req_slots.to(dev), has_prev.to(dev)


def group_mean_cos(q, prev_q, req_slots, G):
    prev = prev_q[req_slots.long()].float()
    cos = torch.nn.functional.cosine_similarity(q.float(), prev, dim=-1)
    return cos.view(q.shape[0], -1, G).mean(-1)


def run_both(q, prev_q, req_slots, has_prev, tau, G, pad_slot=-1):
    prev_ref, has_ref = prev_q.clone(), has_prev.clone()
    # Statistics accumulate onto what is already there.
    stats_ref = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64, device=q.device)
    stats = stats_ref.clone()
    ref = naive_query_similarity(q, prev_ref, req_slots, has_ref, tau, G, stats_ref, pad_slot)
    with poisoned_outputs():
        flags = query_similarity(q, prev_q, req_slots, has_prev, tau, G, stats, pad_slot)
    assert_close("flags", ref, flags)
    torch.testing.assert_close(stats, stats_ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(prev_q.isnan(), prev_ref.isnan()), "prev_q rows outside the batch were written"
    assert_close("prev_q", prev_ref.nan_to_num(), prev_q.nan_to_num())
    assert_close("has_prev", has_ref, has_prev)
    return flags


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("G,D", [(1, 64), (3, 128), (4, 64), (8, 128)])
def test_query_similarity_matches_reference(G, D, dtype):
    q, prev_q, req_slots, has_prev = make_inputs(G, D, dtype)
    tau = 0.5
    # The inputs keep every group mean clear of tau, so fp32 rounding cannot flip a flag.
    assert (group_mean_cos(q, prev_q, req_slots, G) - tau).abs().min() > 1e-3
    mean_before = group_mean_cos(q, prev_q, req_slots, G)
    old_has = has_prev[req_slots.long()].clone()
    flags = run_both(q, prev_q, req_slots, has_prev, tau, G)
    assert torch.equal(flags, (mean_before < tau) | ~old_has[:, None])
    # prev_q now holds this step's query and every batch request has one.
    assert torch.equal(prev_q[req_slots.long()], q) and has_prev[req_slots.long()].all()


@pytest.mark.parametrize("G", [1, 3])
def test_tau_extremes_and_missing_prev(G):
    q, prev_q, req_slots, has_prev = make_inputs(G, 64, torch.float32)
    q[0, :G] = prev_q[req_slots[0].long(), :G]  # identical query: cosine 1, flagged only by tau >= 1
    q[2] = -prev_q[req_slots[2].long()]  # opposite query (has a previous one): cosine -1, not flagged by tau == 0
    snapshot = prev_q.clone(), has_prev.clone()
    no_prev = ~has_prev[req_slots.long()]
    assert no_prev.any() and not no_prev.all()

    flags = run_both(q, prev_q, req_slots, has_prev, 1.0, G)
    assert flags.all()

    prev_q.copy_(snapshot[0])
    has_prev.copy_(snapshot[1])
    flags = run_both(q, prev_q, req_slots, has_prev, 0.0, G)
    assert torch.equal(flags, no_prev[:, None].expand(B, H))

    # Second step: every request now has a previous query, equal to the current one.
    flags = run_both(q, prev_q, req_slots, has_prev, 0.99, G)
    assert not flags.any()


def test_statistics_count_real_rows_only():
    """Flagged heads, and the cosine sum and count of rows that had a previous query; a padding row counts nothing."""
    G = 3
    q, prev_q, req_slots, has_prev = make_inputs(G, 64, torch.float32)
    tau = 0.5
    mean = group_mean_cos(q, prev_q, req_slots, G)
    had = has_prev[req_slots.long()].clone()
    pad = int(req_slots[3])
    real = req_slots != pad
    flags = (mean < tau) | ~had[:, None]
    stats = torch.zeros(3, dtype=torch.float64, device=q.device)
    query_similarity(q, prev_q, req_slots, has_prev, tau, G, stats, pad)
    counted = real & had
    assert stats[0].item() == (flags & real[:, None]).sum().item()
    assert abs(stats[1].item() - mean[counted].sum().item()) < 1e-4
    assert stats[2].item() == counted.sum().item() * H


@pytest.mark.parametrize("H_,G,k", [(1, 8, 5), (3, 1, 16), (3, 3, 1), (2, 4, 37), (8, 4, 7)])
def test_heads_that_select_before_attention(H_, G, k):
    """heads[b, h] = flagged, or fewer pages held than the row's slots to fill; only [:B, :H] of the buffer is
    written (checked with both fills), and the slot table is only read."""
    D, Hq = 64, H_ * G
    dev = device()
    req_slots = torch.randperm(R)[:B].to(torch.int32)
    pad = int(req_slots[4])
    prev_q = torch.randn(R, Hq, D)
    q = torch.where(torch.rand(B, Hq, 1) < 0.5, prev_q[req_slots.long()], torch.randn(B, Hq, D))
    has_prev = torch.rand(R) < 0.8
    table = torch.randint(0, 50, (R, H_, k), dtype=torch.int32)
    table[torch.rand(R, H_, k) < 0.3] = -1
    table[req_slots[0].long()] = -1  # a new request: every slot empty
    n_slots = torch.randint(0, k + 1, (B,), dtype=torch.int32)
    n_slots[1] = k
    args = [t.to(dev) for t in (q, prev_q, req_slots, has_prev)]
    table, n_slots = table.to(dev), n_slots.to(dev)
    ref_heads = torch.zeros(B, H_, dtype=torch.bool, device=dev)
    ref_prev, ref_has = args[1].clone(), args[3].clone()
    flags_ref = naive_query_similarity(args[0], ref_prev, args[2], ref_has, 0.9, G, None, pad, table, n_slots,
                                       ref_heads)
    held = (table[req_slots.long().to(dev)] >= 0).sum(-1)
    assert torch.equal(ref_heads, flags_ref | (held < n_slots[:, None]))
    for fill in (False, True):
        buf = torch.full((B + 2, H_ + 1), fill, dtype=torch.bool, device=dev)
        prev, has = args[1].clone(), args[3].clone()
        table_before = table.clone()
        with poisoned_outputs():
            flags = query_similarity(args[0], prev, args[2], has, 0.9, G, None, pad, table, n_slots, buf[1:B + 1, :H_])
        assert_close("flags", flags_ref, flags)
        assert_close("heads", ref_heads, buf[1:B + 1, :H_])
        untouched = torch.ones_like(buf)
        untouched[1:B + 1, :H_] = False
        assert (buf[untouched] == fill).all(), "heads written outside [:B, :H]"
        assert torch.equal(table, table_before)
        assert_close("prev_q", ref_prev, prev)
        assert_close("has_prev", ref_has, has)


@pytest.mark.parametrize("G,D,nb", [(1, 64, 1), (3, 128, 4), (4, 64, 16), (8, 128, 4), (4, 128, 3)])
def test_sketch_picks_by_slot(G, D, nb):
    """With picks, each row's sketch picks (naive_sketch_picks: bytes by group |q|, ties by the lower byte, and the
    fp16-rounded scaled query on their channels, 0 for padding heads) land at its request slot; other slots keep
    what they held."""
    q, prev_q, req_slots, has_prev = make_inputs(G, D, torch.bfloat16)
    q[0, :G] = 0.0
    q[0, :G, 4:12] = 1.0  # the first KV head: a tie of bytes 1 and 2, then of every other byte (zeros)
    gp = 1 << (G - 1).bit_length()
    sel = torch.full((R, H, nb), -7, dtype=torch.int32, device=q.device)
    qp = torch.full((R, H, 4 * nb, gp), float("nan"), device=q.device)
    prev_ref, has_ref, sel_ref, qp_ref = prev_q.clone(), has_prev.clone(), sel.clone(), qp.clone()
    naive_query_similarity(q, prev_ref, req_slots, has_ref, 0.5, G, picks=(sel_ref, qp_ref), pick_scale=0.3)
    query_similarity(q, prev_q, req_slots, has_prev, 0.5, G, picks=(sel, qp), pick_scale=0.3)
    assert torch.equal(sel, sel_ref)
    assert torch.equal(qp.isnan(), qp_ref.isnan()) and torch.equal(qp.nan_to_num(), qp_ref.nan_to_num())
    mine = req_slots.long()
    assert (sel[mine] >= 0).all() and not qp[mine].isnan().any()
    others = torch.ones(R, dtype=torch.bool)
    others[mine.cpu()] = False
    assert (sel[others] == -7).all() and qp[others].isnan().all()
    assert not qp[mine][..., G:].any()
    assert sel[mine[0], 0].tolist() == [1, 2, 0, *range(3, nb)][:nb]  # ties: the lower byte first


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("G,D", [(1, 64), (3, 32), (4, 128), (8, 16)])
def test_kv_write_in_the_same_launch(G, D, cache_dtype):
    """kv=(k, v, k_cache, v_cache, loc): each row's new K/V lands in its cache row, other rows stay as they were,
    and the flags and prev_q update are the same as without it."""
    q, prev_q, req_slots, has_prev = make_inputs(G, D, torch.float32)
    dev, T = q.device, 23
    k, v = (torch.randn(B, H, D, device=dev).to(cache_dtype) for _ in range(2))
    loc = torch.randperm(T, device=dev)[:B].to(torch.int32)
    caches = [torch.full((T, H, D), float("nan"), dtype=cache_dtype, device=dev) for _ in range(4)]
    prev_ref, has_ref = prev_q.clone(), has_prev.clone()
    ref = naive_query_similarity(q, prev_ref, req_slots, has_ref, 0.5, G, kv=(k, v, caches[0], caches[1], loc))
    flags = query_similarity(q, prev_q, req_slots, has_prev, 0.5, G, kv=(k, v, caches[2], caches[3], loc))
    assert torch.equal(flags, ref) and torch.equal(has_prev, has_ref)
    assert torch.equal(prev_q.nan_to_num(), prev_ref.nan_to_num())
    written = torch.zeros(T, dtype=torch.bool, device=dev)
    written[loc.long()] = True
    for name, got, want, new in (("k", caches[2], caches[0], k), ("v", caches[3], caches[1], v)):
        assert got[~written].isnan().all(), f"{name}: rows outside loc were written"
        assert_close(name, want[written], got[written], atol=0, rtol=0)
        assert torch.equal(got[loc.long()], new), name


@pytest.mark.parametrize("G,D", [(1, 64), (3, 128), (4, 32), (8, 64)])
def test_replayed_flags_follow_the_draws_not_tau(G, D):
    """replay=(u, rate): flags are u < rate (or no previous query) whatever the cosines and tau; the cosines are
    still counted, and prev_q is updated as without it."""
    q, prev_q, req_slots, has_prev = make_inputs(G, D, torch.float32)
    dev = q.device
    u = torch.rand(B, H, device=dev)
    u[0, 0], u[3, -1] = 0.0, 0.999  # one draw certainly below, one certainly above the rate
    old_has = has_prev[req_slots.long()].clone()
    for tau in (0.0, 0.5, 1.0):
        p_ref, h_ref, p_tri, h_tri = prev_q.clone(), has_prev.clone(), prev_q.clone(), has_prev.clone()
        s_ref = torch.zeros(3, dtype=torch.float64, device=dev)
        s_tri = s_ref.clone()
        ref = naive_query_similarity(q, p_ref, req_slots, h_ref, tau, G, s_ref, replay=(u, 0.35))
        with poisoned_outputs():
            flags = query_similarity(q, p_tri, req_slots, h_tri, tau, G, s_tri, replay=(u, 0.35))
        assert torch.equal(flags, ref)
        assert torch.equal(flags, (u < 0.35) | ~old_has[:, None])
        torch.testing.assert_close(s_tri, s_ref, rtol=1e-5, atol=1e-5)
        assert s_ref[2] > 0, "the cosines of rows with a previous query are still counted"
        assert torch.equal(p_tri.nan_to_num(), p_ref.nan_to_num()) and torch.equal(h_tri, h_ref)


@pytest.mark.parametrize("replayed", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("G,D", [(1, 64), (3, 128), (4, 32), (8, 64)])
def test_early_flags_only_rows_with_a_previous_query_and_moves_only_their_queries(G, D, dtype, replayed):
    """early=True (the correction one layer early, q a prediction): flags where the cosine test (or the draw) says
    so, but only for rows with a previous query and a real slot; only flagged heads' previous queries become q;
    has_prev is untouched; stats [1] counts the flags; out receives them."""
    q, prev_q, req_slots, has_prev = make_inputs(G, D, dtype)
    dev = q.device
    pad = int(req_slots[4])  # row 4 is padding: never flagged
    has_prev[req_slots[4]] = True
    u = torch.rand(B, H, device=dev)
    replay = (u, 0.5) if replayed else None
    tau = 0.5
    turned = u < 0.5 if replayed else group_mean_cos(q, prev_q, req_slots, G) < tau
    want = turned & (has_prev[req_slots.long()] & (req_slots != pad))[:, None]
    assert want.any() and not want.all()
    old_prev, old_has = prev_q.clone(), has_prev.clone()
    p_ref, s_ref = prev_q.clone(), torch.tensor([2.0], dtype=torch.float64, device=dev)
    p_tri, s_tri = prev_q.clone(), s_ref.clone()
    out_ref, out = torch.ones(B, H, dtype=torch.bool, device=dev), torch.ones(B, H, dtype=torch.bool, device=dev)
    ref = naive_query_similarity(q, p_ref, req_slots, has_prev, tau, G, s_ref, pad, replay=replay, early=True,
                                 out=out_ref)
    got = query_similarity(q, p_tri, req_slots, has_prev, tau, G, s_tri, pad, replay=replay, early=True, out=out)
    for flags in (ref, out_ref, got, out):
        assert torch.equal(flags, want)
    assert got.data_ptr() == out.data_ptr(), "the flags go to out"
    torch.testing.assert_close(s_tri, s_ref, rtol=0, atol=0)
    assert s_ref.item() == 2.0 + want.sum().item()
    assert torch.equal(has_prev, old_has), "has_prev is left as it is"
    assert torch.equal(p_tri.isnan(), old_prev.isnan()), "prev_q rows outside the batch were written"
    moved = want.repeat_interleave(G, dim=1)[..., None].expand(-1, -1, D)
    rows = req_slots.long()
    for p in (p_ref, p_tri):
        assert torch.equal(p[rows][moved], q.to(p.dtype)[moved]), "a flagged head's previous query becomes q"
        assert torch.equal(p[rows][~moved].nan_to_num(), old_prev[rows][~moved].nan_to_num()), \
            "an unflagged head's previous query stays"
