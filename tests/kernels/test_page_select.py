"""score_pages / select_pages / slot_delta against their torch references, plus semantic properties."""

import math

import pytest
import torch

from freekv_kernels.page_select import (
    PHASE_LATER,
    PHASE_NOW,
    naive_score_pages,
    naive_select_pages,
    naive_slot_delta,
    score_pages,
    select_pages,
    slot_delta,
)
from freekv_kernels.page_select import triton as page_select_triton
from freekv_kernels.testing import assert_close, device, poisoned_outputs

B, H, R = 5, 2, 7
CAND_START = 2


def make_score_inputs(G, page_size, D, M, dtype, H=H):
    """Random q, min/max summaries of random keys, distinct host pages per request, varied candidate ranges.

    Built on CPU so every device sees the same values.
    """
    P = M + 20
    keys = torch.randn(P, H, page_size, D)
    summaries = torch.stack([keys.amin(dim=2), keys.amax(dim=2)], dim=2).to(dtype)
    q = torch.randn(B, H * G, D).to(dtype)
    page_table = torch.stack([torch.randperm(P)[:M] for _ in range(R)]).to(torch.int32)
    req_slots = torch.randperm(R)[:B].to(torch.int32)
    # All candidates, none (end == start, end < start), a single one, a partial range.
    cand_end = torch.tensor([M, CAND_START, 1, CAND_START + 1, M // 2 + 3], dtype=torch.int32)
    for b in range(B):  # pages past the written range are unallocated: never read
        page_table[req_slots[b], max(int(cand_end[b]), CAND_START):] = -1
    dev = device()
    return q.to(dev), summaries.to(dev), page_table.to(dev), req_slots.to(dev), cand_end.to(dev)


# (G, page_size, D, M): odd M; M > 64 spans several page blocks, M = 300 several pooling chunks.
SCORE_SHAPES = [(1, 16, 64, 37), (3, 32, 128, 300), (4, 16, 128, 150), (8, 32, 64, 133)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pooling", ["mean_softmax", "max"])
@pytest.mark.parametrize("G,page_size,D,M", SCORE_SHAPES)
def test_score_pages_matches_reference(G, page_size, D, M, pooling, dtype):
    q, summaries, page_table, req_slots, cand_end = make_score_inputs(G, page_size, D, M, dtype)
    scale = 1 / math.sqrt(D)
    with poisoned_outputs():
        out = score_pages(q, summaries, page_table, req_slots, CAND_START, cand_end, scale, pooling)
    ref = naive_score_pages(q, summaries, page_table, req_slots, CAND_START, cand_end, scale, pooling)
    assert_close("scores", ref, out, atol=1e-5 if pooling == "mean_softmax" else 1e-4, rtol=1e-4)
    # Candidates are exactly the finite entries; rows without candidates are all -inf.
    j = torch.arange(M, device=out.device)
    is_cand = (j >= CAND_START) & (j < cand_end[:, None])
    assert torch.equal(torch.isfinite(out), is_cand[:, None, :].expand(B, H, M))
    if pooling == "mean_softmax":  # a mean of softmaxes sums to 1 over the candidates of a non-empty row
        sums = torch.where(is_cand[:, None, :], out, 0.0).sum(-1)
        expect = is_cand.any(-1).float()[:, None].expand(B, H)
        torch.testing.assert_close(sums, expect, atol=1e-5, rtol=0)


@pytest.mark.parametrize("phase", [PHASE_NOW, PHASE_LATER])
@pytest.mark.parametrize("pooling", ["mean_softmax", "max"])
@pytest.mark.parametrize("H_,G,page_size,D,M", [(1, 8, 16, 64, 37), (2, 3, 32, 128, 300), (3, 4, 16, 64, 150)])
def test_score_pages_heads_of_a_phase(H_, G, page_size, D, M, pooling, phase):
    """heads [B, H] and a phase: only the phase's heads (heads == True before attention, False after) are
    scored, exactly as without a mask; the other heads' rows stay unwritten. q_by_slot reads q[req_slots[b]]."""
    q, summaries, page_table, req_slots, cand_end = make_score_inputs(G, page_size, D, M, torch.float32, H_)
    heads = torch.rand(B, H_) < 0.5
    heads[0] = True
    heads[1] = False
    heads = heads.to(q.device)
    mine = heads if phase == PHASE_NOW else ~heads
    scale = 1 / math.sqrt(D)
    full = naive_score_pages(q, summaries, page_table, req_slots, CAND_START, cand_end, scale, pooling)
    ref = naive_score_pages(q, summaries, page_table, req_slots, CAND_START, cand_end, scale, pooling, heads, phase)
    assert torch.equal(ref[mine], full[mine]) and ref[~mine].isnan().all()
    # q by request slot: rows of q that no batch row maps to are NaN (never read).
    q_slots = torch.full((R, H_ * G, D), float("nan"), device=q.device)
    q_slots[req_slots.long()] = q
    for qq, by_slot in ((q, False), (q_slots, True)):
        with poisoned_outputs():
            out = score_pages(qq, summaries, page_table, req_slots, CAND_START, cand_end, scale, pooling, heads, phase,
                              by_slot)
        assert out[~mine].isnan().all(), "a head outside the phase was written"
        assert_close("scores", ref[mine], out[mine], atol=1e-5 if pooling == "mean_softmax" else 1e-4, rtol=1e-4)


@pytest.mark.parametrize("pooling", ["mean_softmax", "max"])
def test_score_pages_small_blocks(monkeypatch, pooling):
    """Many logits blocks (per-block softmax statistics combined across blocks) and many pooling blocks."""
    mod = page_select_triton
    monkeypatch.setattr(mod, "LOGITS_BLOCK_PAGES", 4)
    monkeypatch.setattr(mod, "POOL_BLOCK", 32)
    G, page_size, D, M = 4, 32, 128, 150
    q, summaries, page_table, req_slots, cand_end = make_score_inputs(G, page_size, D, M, torch.bfloat16)
    with poisoned_outputs():
        out = mod.score_pages(q, summaries, page_table, req_slots, CAND_START, cand_end, 0.1, pooling)
    ref = naive_score_pages(q, summaries, page_table, req_slots, CAND_START, cand_end, 0.1, pooling)
    assert_close("scores", ref, out, atol=1e-5 if pooling == "mean_softmax" else 1e-4, rtol=1e-4)


def test_max_pooling_is_max_of_raw_scores():
    G, D, M = 3, 64, 37
    q, summaries, page_table, req_slots, cand_end = make_score_inputs(G, 16, D, M, torch.float32)
    with poisoned_outputs():
        out = score_pages(q, summaries, page_table, req_slots, CAND_START, cand_end, 0.5, "max")
    b, j = 0, CAND_START + 3  # row 0 has every page as a candidate
    summ = summaries[page_table[req_slots[b], j].long()].float()  # [H, 2, D]
    qb = q[b].float().view(H, G, D)
    raw = 0.5 * torch.maximum(qb * summ[:, None, 0], qb * summ[:, None, 1]).sum(-1)
    torch.testing.assert_close(out[b, :, j], raw.amax(-1), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("k", [1, 7, 37, 40])
def test_select_pages_matches_reference(k):
    M = 37
    # Distinct scores (a permutation) with -inf holes, and a row that is all -inf.
    scores = torch.stack([torch.randperm(M).float() for _ in range(B * H)]).view(B, H, M)
    scores[torch.rand(B, H, M) < 0.3] = float("-inf")
    scores[1] = float("-inf")
    scores = scores.to(device())
    with poisoned_outputs():
        sel = select_pages(scores, k)
    assert_close("sel", naive_select_pages(scores, k), sel)


@pytest.mark.parametrize("chunk", [8, 32])
@pytest.mark.parametrize("k", [1, 3, 16])
def test_select_pages_chunked_with_ties(monkeypatch, chunk, k):
    """Several top-k stages (chunks, then the chunks' winners) equal the reference, ties by lower page included."""
    monkeypatch.setattr(page_select_triton, "TOPK_CHUNK", chunk)
    monkeypatch.setattr(page_select_triton, "TOPK_SINGLE", chunk)
    M = 150
    scores = torch.randint(-3, 4, (B, H, M)).float()  # many ties, negative scores
    scores[scores == 0] = torch.where(torch.rand(int((scores == 0).sum())) < 0.5, 0.0, -0.0)  # -0.0 ties +0.0
    scores[torch.rand(B, H, M) < 0.3] = float("-inf")
    scores[1] = float("-inf")
    scores[3, 1] = torch.randn(M) * 1e3  # distinct values of both signs
    scores[4, 0, : M - 5] = float("-inf")  # fewer finite scores than k
    scores = scores.to(device())
    with poisoned_outputs():
        sel = page_select_triton.select_pages(scores, k)
    assert_close("sel", naive_select_pages(scores, k), sel)


@pytest.mark.parametrize("pooling", ["mean_softmax", "max"])
def test_every_candidate_selected_when_k_covers_them(pooling):
    G, D, M = 4, 64, 37
    q, summaries, page_table, req_slots, cand_end = make_score_inputs(G, 32, D, M, torch.bfloat16)
    with poisoned_outputs():
        scores = score_pages(q, summaries, page_table, req_slots, CAND_START, cand_end, 0.125, pooling)
        sel = select_pages(scores, M - CAND_START)
    for b in range(B):
        want = set(range(CAND_START, max(int(cand_end[b]), CAND_START)))
        for h in range(H):
            row = sel[b, h].tolist()
            assert set(row) - {-1} == want and row.count(-1) == len(row) - len(want)


def make_slot_inputs(k, n_pages):
    """old: distinct pages with -1 holes; sel: distinct pages overlapping old, -1 padded at the end."""
    old = torch.full((B, H, k), -1, dtype=torch.int32)
    sel = torch.full((B, H, k), -1, dtype=torch.int32)
    for b in range(B):
        for h in range(H):
            pages = torch.randperm(n_pages)
            old[b, h] = pages[:k].to(torch.int32)
            old[b, h][torch.rand(k) < 0.2] = -1
            n_sel = [k, 0, k // 2, k - 1, 1][b]
            sel[b, h, :n_sel] = pages[torch.randperm(2 * k)[:n_sel]].to(torch.int32)  # about half resident
    old[0, 0, k // 2] = -1  # an empty slot and a full selection
    resident = old[2, 1][old[2, 1] != -1].flip(0)  # re-selecting exactly the resident pages changes nothing
    sel[2, 1] = -1
    sel[2, 1, : len(resident)] = resident
    return old.to(device()), sel.to(device())


@pytest.mark.parametrize("k", [1, 5, 16, 37, 256])
def test_slot_delta(k):
    old, sel = make_slot_inputs(k, 3 * k + 4)
    with poisoned_outputs():
        new, changed = slot_delta(old, sel)
    ref_new, ref_changed = naive_slot_delta(old, sel)
    assert_close("new", ref_new, new)
    assert_close("changed", ref_changed, changed)
    for b in range(B):
        for h in range(H):
            o, s, n = old[b, h].tolist(), sel[b, h].tolist(), new[b, h].tolist()
            wanted = set(s) - {-1}
            assert all(n[i] == o[i] for i in range(k) if o[i] in wanted), "a resident page moved"
            assert set(n) - {-1} == wanted and n.count(-1) == k - len(wanted)
            assert changed[b, h].tolist() == [n[i] != -1 and n[i] != o[i] for i in range(k)]
    assert not changed[2, 1].any()
