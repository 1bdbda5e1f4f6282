"""score_pages / select_slots against their torch references, plus semantic properties."""

import math

import pytest
import torch

from freekv_kernels.page_select import (
    PHASE_LATER,
    PHASE_NOW,
    naive_score_pages,
    naive_select_slots,
    score_pages,
    select_slots,
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


HEADS_SHAPES = [(1, 8, 16, 64, 37, torch.bfloat16), (2, 3, 32, 128, 300, torch.float32),
                (3, 4, 16, 64, 150, torch.bfloat16), (2, 1, 32, 64, 20, torch.float32)]


@pytest.mark.parametrize("phase", [PHASE_NOW, PHASE_LATER])
@pytest.mark.parametrize("pooling", ["mean_softmax", "max"])
@pytest.mark.parametrize("H_,G,page_size,D,M,dtype", HEADS_SHAPES)
def test_score_pages_heads_of_a_phase(H_, G, page_size, D, M, dtype, pooling, phase):
    """heads [B, H] and a phase: only the phase's heads (heads == True before attention, False after) are
    scored, exactly as without a mask; the other heads' rows stay unwritten. q_by_slot reads q[req_slots[b]]."""
    q, summaries, page_table, req_slots, cand_end = make_score_inputs(G, page_size, D, M, dtype, H_)
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
    q_slots = torch.full((R, H_ * G, D), float("nan"), dtype=dtype, device=q.device)
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


def run_select(fn, scores, slots, req_slots, heads, phase, flags, recall, recall_all=False, pad_slot=-1,
               hysteresis=0.0):
    """fn on copies of the in-place tensors, recall as the view [:B] of its buffer (stats start non-zero: they
    accumulate); returns the slot table, the whole recall buffer, the stats and the scores (hysteresis writes)."""
    scores, slots, recall = scores.clone(), slots.clone(), recall.clone()
    stats = torch.tensor([5.0, 7.0], dtype=torch.float64, device=scores.device)
    fn(scores, slots, req_slots, heads, phase, flags, recall[:req_slots.shape[0]], recall_all, stats, pad_slot,
       hysteresis)
    return slots, recall, stats, scores


def check_select(scores, slots, req_slots, heads, phase, flags, recall, recall_all=False, pad_slot=-1,
                 hysteresis=0.0):
    """select_slots equals the reference on every output, and writes only the batch's slot-table rows and
    recall rows [:B] (rows past B of the recall buffer are sentinels); the scores as the reference leaves them
    (hysteresis multiplies the resident pages' in place; rows of other heads untouched)."""
    B = req_slots.shape[0]
    ref = run_select(naive_select_slots, scores, slots, req_slots, heads, phase, flags, recall, recall_all, pad_slot,
                     hysteresis)
    with poisoned_outputs():
        out = run_select(select_slots, scores, slots, req_slots, heads, phase, flags, recall, recall_all, pad_slot,
                         hysteresis)
    assert torch.equal(out[3].isnan(), ref[3].isnan()) and torch.equal(out[3].nan_to_num(), ref[3].nan_to_num())
    if not hysteresis:
        assert torch.equal(ref[3].isnan(), scores.isnan()) and torch.equal(ref[3].nan_to_num(), scores.nan_to_num())
    assert_close("slots", ref[0], out[0])
    assert_close("recall", ref[1], out[1])
    assert torch.equal(out[1][B:], recall[B:]), "recall rows past the batch were written"
    torch.testing.assert_close(out[2], ref[2], atol=0, rtol=0)
    return ref


def fresh_table(k, R=R, H_=H):
    """A slot table of new requests (every slot empty), with sentinel rows for the requests outside the batch."""
    return torch.full((R, H_, k), -1, dtype=torch.int32, device=device())


@pytest.mark.parametrize("k", [1, 7, 37, 40])
def test_select_slots_top_k_of_new_requests(k):
    """Empty slots take the top k pages in score order (ties by lower page), -1 where scores run out."""
    M = 37
    # Distinct scores (a permutation) with -inf holes, and a row that is all -inf.
    scores = torch.stack([torch.randperm(M).float() for _ in range(B * H)]).view(B, H, M)
    scores[torch.rand(B, H, M) < 0.3] = float("-inf")
    scores[1] = float("-inf")
    scores = scores.to(device())
    req_slots = torch.randperm(R)[:B].int().to(device())
    table = fresh_table(k)
    heads = torch.ones(B, H, dtype=torch.bool, device=device())
    flags = torch.rand(B, H, device=device()) < 0.5
    recall = torch.full((B + 1, H, k), 9, dtype=torch.int8, device=device())
    slots, codes, _, _ = check_select(scores, table, req_slots, heads, PHASE_NOW, flags, recall)
    order = torch.sort(scores.cpu(), dim=-1, descending=True, stable=True)
    for b, r in enumerate(req_slots.tolist()):
        for h in range(H):
            want = [j if v != float("-inf") else -1 for v, j in zip(order.values[b, h, :k].tolist(),
                                                                     order.indices[b, h, :k].tolist())]
            want += [-1] * (k - len(want))
            assert slots[r, h].tolist() == want
            # every slot was empty: each filled one is recalled before attention
            assert codes[b, h].tolist() == [PHASE_NOW if p != -1 else 0 for p in want]


@pytest.mark.parametrize("chunk", [8, 32])
@pytest.mark.parametrize("k", [1, 3, 16])
def test_select_slots_chunked_with_ties(monkeypatch, chunk, k):
    """Several top-k stages (chunks, then the chunks' winners) equal the reference, ties by lower page included;
    a head outside the phase has a NaN score row that no stage may read."""
    monkeypatch.setattr(page_select_triton, "TOPK_CHUNK", chunk)
    monkeypatch.setattr(page_select_triton, "TOPK_SINGLE", chunk)
    M = 150
    scores = torch.randint(-3, 4, (B, H, M)).float()  # many ties, negative scores
    scores[scores == 0] = torch.where(torch.rand(int((scores == 0).sum())) < 0.5, 0.0, -0.0)  # -0.0 ties +0.0
    scores[torch.rand(B, H, M) < 0.3] = float("-inf")
    scores[1] = float("-inf")
    scores[3, 1] = torch.randn(M) * 1e3  # distinct values of both signs
    scores[4, 0, : M - 5] = float("-inf")  # fewer finite scores than k
    heads = torch.ones(B, H, dtype=torch.bool)
    heads[2, 1] = False
    scores[2, 1] = float("nan")
    dev = device()
    scores, heads = scores.to(dev), heads.to(dev)
    req_slots = torch.randperm(R)[:B].int().to(dev)
    table = fresh_table(k)
    table[req_slots[2].long(), 1] = torch.arange(k, dtype=torch.int32)  # kept: the head selects later
    recall = torch.zeros(B, H, k, dtype=torch.int8, device=dev)
    flags = torch.zeros(B, H, dtype=torch.bool, device=dev)
    slots, _, _, _ = check_select(scores, table, req_slots, heads, PHASE_NOW, flags, recall)
    assert slots[req_slots[2].long(), 1].tolist() == list(range(k))


def make_slot_inputs(k, n_pages, H_=H):
    """old slot rows: distinct pages with -1 holes; scores whose top k (-inf beyond) are distinct pages that
    overlap the resident ones about half the time."""
    old = torch.full((B, H_, k), -1, dtype=torch.int32)
    scores = torch.full((B, H_, n_pages), float("-inf"))
    sel = torch.full((B, H_, k), -1, dtype=torch.int32)
    for b in range(B):
        for h in range(H_):
            pages = torch.randperm(n_pages)
            old[b, h] = pages[:k].to(torch.int32)
            old[b, h][torch.rand(k) < 0.2] = -1
            n_sel = [k, 0, k // 2, k - 1, 1][b]
            sel[b, h, :n_sel] = pages[torch.randperm(2 * k)[:n_sel]].to(torch.int32)  # about half resident
    old[0, 0, k // 2] = -1  # an empty slot and a full selection
    resident = old[2, 0][old[2, 0] != -1].flip(0)  # re-selecting exactly the resident pages changes nothing
    sel[2, 0] = -1
    sel[2, 0, : len(resident)] = resident
    for b in range(B):
        for h in range(H_):
            chosen = sel[b, h][sel[b, h] != -1].long()
            scores[b, h, chosen] = torch.arange(len(chosen), 0, -1).float()  # in selection order
    return old, sel, scores


# k = 256 (the widest top-k) in one phase without the recall-all ablation only: each such case interprets for ~20 s
# on CPU.
@pytest.mark.parametrize("H_,k,phase,recall_all", [
    (H_, k, phase, recall_all) for H_, k in [(1, 5), (2, 1), (2, 16), (3, 37), (2, 256)]
    for phase in (PHASE_NOW, PHASE_LATER) for recall_all in (False, True)
    if not (k == 256 and (recall_all or phase == PHASE_LATER))])
def test_select_slots_delta_commit_and_recall_codes(H_, k, phase, recall_all):
    """Resident pages keep their slot, new ones fill the free slots in selection order; the phase's heads commit
    to the slot table, the recall codes and statistics follow the contract (a padding row counts nothing)."""
    old, sel, scores = make_slot_inputs(k, 3 * k + 4, H_)
    dev = device()
    req_slots = torch.randperm(R)[:B].int()
    pad = int(req_slots[4])
    table = torch.randint(0, 99, (R, H_, k), dtype=torch.int32)  # rows outside the batch: must stay
    table[req_slots.long()] = old
    heads = torch.rand(B, H_) < 0.5
    heads[0], heads[2] = True, phase == PHASE_NOW
    flags = heads & (torch.rand(B, H_) < 0.5)
    scores[~(heads if phase == PHASE_NOW else ~heads)] = float("nan")  # rows outside the phase: unwritten
    recall = torch.randint(0, 3, (B + 2, H_, k), dtype=torch.int8)  # last step's codes, then 2 sentinel rows
    args = [t.to(dev) for t in (scores, table, req_slots, heads)]
    slots, codes, stats, _ = check_select(*args, phase, flags.to(dev), recall.to(dev), recall_all, pad)
    mine = heads if phase == PHASE_NOW else ~heads
    before = recall[:B]
    now = later = 0
    for b, r in enumerate(req_slots.tolist()):
        for h in range(H_):
            o, n = old[b, h].tolist(), slots[r, h].tolist()
            if not mine[b, h]:
                assert n == o
                changed = [False] * k
            else:
                wanted = set(sel[b, h].tolist()) - {-1}
                assert all(n[i] == o[i] for i in range(k) if o[i] in wanted), "a resident page moved"
                assert set(n) - {-1} == wanted and n.count(-1) == k - len(wanted)
                changed = [p != -1 and (recall_all or p != q) for p, q in zip(n, o)]
            if phase == PHASE_NOW:
                want = [(PHASE_NOW if flags[b, h] or q < 0 else PHASE_LATER) if c else 0 for c, q in zip(changed, o)]
            else:
                want = [PHASE_LATER if c else 0 for c in changed] if mine[b, h] else before[b, h].tolist()
            assert codes[b, h].tolist() == want
            if r != pad:
                now += want.count(PHASE_NOW)
                later += want.count(PHASE_LATER)
    assert stats.tolist() == [5.0 + (now if phase == PHASE_NOW else 0), 7.0 + (later if phase == PHASE_LATER else 0)]
    others = torch.ones(R, dtype=torch.bool)
    others[req_slots.long()] = False
    assert torch.equal(slots[others.to(dev)], table[others].to(dev))
    if not recall_all and mine[2, 0]:
        assert (codes[2, 0] == 0).all()  # re-selecting the resident pages recalls nothing


# Each shape in one phase (the hysteresis does not depend on it; test_select_slots_delta_commit_and_recall_codes
# covers both): the chunked cases interpret for 10-30 s each on CPU.
@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("H_,k,M,phase", [(1, 5, 37, PHASE_NOW), (3, 16, 150, PHASE_LATER), (2, 37, 200, PHASE_NOW),
                                          (8, 1, 33, PHASE_LATER)])
def test_select_slots_hysteresis_matches_reference(monkeypatch, chunked, H_, k, M, phase):
    """Resident pages count (1 + h) times their score: kernel and reference agree on random masses, in one stage and
    in chunked stages (the first stage applies it), with resident pages that score exactly the factor's boundary."""
    if chunked:
        monkeypatch.setattr(page_select_triton, "TOPK_CHUNK", 32)
        monkeypatch.setattr(page_select_triton, "TOPK_SINGLE", 32)
    dev = device()
    scores = torch.softmax(torch.randn(B, H_, M) * 2, dim=-1)
    scores[torch.rand(B, H_, M) < 0.2] = float("-inf")
    scores[:, :, :CAND_START] = float("-inf")
    req_slots = torch.randperm(R)[:B].int()
    table = torch.randint(0, 99, (R, H_, k), dtype=torch.int32)
    for b, r in enumerate(req_slots.tolist()):
        for h in range(H_):
            table[r, h] = torch.randperm(M)[:k].int()
            table[r, h][torch.rand(k) < 0.2] = -1
    r0 = int(req_slots[0])
    held = int(table[r0, 0][table[r0, 0] >= 0][0]) if (table[r0, 0] >= 0).any() else None
    if held is not None and k > 1:  # a challenger exactly (1 + h) times a resident page ties it; the lower page wins
        scores[0, 0, held] = 0.25
        scores[0, 0, (held + 1) % M] = float(torch.tensor(0.25, dtype=torch.float32) * 2.0)
    heads = torch.rand(B, H_) < 0.5
    heads[0] = phase == PHASE_NOW
    flags = heads & (torch.rand(B, H_) < 0.5)
    scores[~(heads if phase == PHASE_NOW else ~heads)] = float("nan")
    recall = torch.randint(0, 3, (B + 1, H_, k), dtype=torch.int8)
    args = [t.to(dev) for t in (scores, table, req_slots, heads)]
    for h_ in (0.5, 1.0):
        check_select(*args, phase, flags.to(dev), recall.to(dev), False, -1, h_)


def test_hysteresis_keeps_resident_pages_unless_outscored():
    """A resident page (0.20) stays against a challenger (0.35) below (1 + h) times its score and goes past it;
    h = 0 is the plain top-k; a negative or infinite h is refused."""
    dev = device()
    scores = torch.tensor([[[float("-inf"), 0.30, 0.20, 0.35, 0.15]]], device=dev)
    req_slots = torch.tensor([0], dtype=torch.int32, device=dev)
    heads = torch.ones(1, 1, dtype=torch.bool, device=dev)
    recall = torch.zeros(1, 1, 2, dtype=torch.int8, device=dev)
    held = torch.tensor([[[1, 2]]], dtype=torch.int32, device=dev)  # pages 1 (0.30) and 2 (0.20) resident
    for h_, want in [(0.0, [1, 3]), (0.5, [1, 3]), (0.74, [1, 3]), (0.76, [1, 2]), (1.0, [1, 2])]:
        slots, codes, _, _ = check_select(scores, held, req_slots, heads, PHASE_NOW, heads, recall, hysteresis=h_)
        assert slots[0, 0].tolist() == want, h_
    for bad in (-0.1, float("inf"), True):
        with pytest.raises(ValueError, match="hysteresis"):
            select_slots(scores, held.clone(), req_slots, heads, PHASE_NOW, heads, recall, hysteresis=bad)


@pytest.mark.parametrize("pooling", ["mean_softmax", "max"])
def test_every_candidate_selected_when_k_covers_them(pooling):
    G, D, M = 4, 64, 37
    q, summaries, page_table, req_slots, cand_end = make_score_inputs(G, 32, D, M, torch.bfloat16)
    k = M - CAND_START
    table = fresh_table(k)
    heads = torch.ones(B, H, dtype=torch.bool, device=q.device)
    recall = torch.zeros(B, H, k, dtype=torch.int8, device=q.device)
    with poisoned_outputs():
        scores = score_pages(q, summaries, page_table, req_slots, CAND_START, cand_end, 0.125, pooling)
        select_slots(scores, table, req_slots, heads, PHASE_NOW, heads, recall)
    for b, r in enumerate(req_slots.tolist()):
        want = set(range(CAND_START, max(int(cand_end[b]), CAND_START)))
        for h in range(H):
            row = table[r, h].tolist()
            assert set(row) - {-1} == want and row.count(-1) == len(row) - len(want)
