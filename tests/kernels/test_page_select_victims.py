"""select_slots with a victim cache against its torch reference, and the cache's invariants."""

import pytest
import torch

from freekv_kernels.page_select import PHASE_LATER, PHASE_NOW, naive_select_slots, select_slots
from freekv_kernels.page_select.naive import unpack_victim_op, victim_op
from freekv_kernels.testing import assert_close, device

B, R = 5, 7


def make_inputs(H, k, V, n_pages, seed):
    """Per (row, head): resident slots with holes, victim entries holding other pages (some free, stamps with ties),
    and scores whose top k keep about half the resident pages and take about half their new pages from the
    victim entries. Built on CPU so every device sees the same values."""
    g = torch.Generator().manual_seed(seed)
    req_slots = torch.randperm(R, generator=g)[:B].int()
    table = torch.randint(0, n_pages, (R, H, k), dtype=torch.int32, generator=g)  # rows outside the batch stay
    victims = torch.randint(0, n_pages, (R, H, V), dtype=torch.int32, generator=g)
    age = torch.randint(0, 4, (R, H, V), dtype=torch.int32, generator=g)
    scores = torch.full((B, H, n_pages), float("-inf"))
    for b, r in enumerate(req_slots.tolist()):
        for h in range(H):
            pages = torch.randperm(n_pages, generator=g)
            old = pages[:k].int()
            old[torch.rand(k, generator=g) < 0.2] = -1
            held = pages[k:k + V].int()
            free = torch.rand(V, generator=g) < 0.25
            held[free] = -1
            table[r, h], victims[r, h] = old, held
            age[r, h] = torch.where(free, -1, age[r, h])
            n_sel = [k, k // 2, 1, k, 0][b]
            pool = torch.cat([pages[:k], pages[k:k + V], pages[k + V:k + V + k]])
            chosen = pool[torch.randperm(len(pool), generator=g)[:n_sel]]
            scores[b, h, chosen] = torch.arange(len(chosen), 0, -1).float()
    heads = torch.rand(B, H, generator=g) < 0.6
    flags = heads & (torch.rand(B, H, generator=g) < 0.5)
    ops = torch.randint(0, 1 << 20, (B, H, k), dtype=torch.int32, generator=g)  # last step's ops: other heads keep
    recall = torch.randint(0, 3, (B, H, k), dtype=torch.int8, generator=g)
    dev = device()
    return [t.to(dev) for t in (scores, table, req_slots, heads, flags, recall, victims, age, ops)]


def run(fn, scores, table, req_slots, heads, flags, recall, victims, age, ops, phase, pad):
    scores, table, recall, victims, age, ops = (t.clone() for t in (scores, table, recall, victims, age, ops))
    stats = torch.tensor([5.0, 7.0, 11.0, 13.0], dtype=torch.float64, device=scores.device)
    fn(scores, table, req_slots, heads, phase, flags, recall, False, stats, pad, 1.0, victims, age, ops)
    return table, recall, stats, victims, age, ops


@pytest.mark.parametrize("phase", [PHASE_NOW, PHASE_LATER])
# V > k: more entries than slots (the kernel's top-k of the entries instead of all their ranks), up to four
# budgets' worth
@pytest.mark.parametrize("H,k,V", [(1, 5, 1), (2, 7, 3), (3, 16, 16), (2, 37, 20), (8, 4, 64), (2, 8, 40),
                                   (3, 16, 64)])
def test_select_slots_victims_match_reference(H, k, V, phase):
    inputs = make_inputs(H, k, V, 3 * k + V + 5, seed=H * 1000 + k * 10 + V)
    pad = int(inputs[2][3])
    ref = run(naive_select_slots, *inputs, phase, pad)
    out = run(select_slots, *inputs, phase, pad)
    for name, a, b in zip(("slots", "recall", "stats", "victims", "age", "ops"), ref, out):
        assert_close(name, a, b, atol=0, rtol=0)
    _check_invariants(inputs, ref, phase, pad)


def _check_invariants(inputs, ref, phase, pad):
    """Each incoming page an entry held comes from it, each outgoing page lands in an entry no hit read, and no
    page is both in a slot and in an entry of its head afterwards; heads outside the phase keep their entries and
    ops; the hit statistics count the phase's hits."""
    scores, table, req_slots, heads, flags, recall, victims, age, ops = (t.cpu() for t in inputs)
    slots, codes, stats, new_v, new_age, new_ops = (t.cpu() for t in ref)
    mine = heads if phase == PHASE_NOW else ~heads
    hits = 0
    for b, r in enumerate(req_slots.tolist()):
        for h in range(table.shape[1]):
            if not mine[b, h] or r == pad:
                assert torch.equal(new_v[r, h], victims[r, h]) and torch.equal(new_age[r, h], age[r, h])
                if not mine[b, h]:
                    assert torch.equal(new_ops[b, h], ops[b, h])
                else:
                    assert (new_ops[b, h] == 0).all()
                continue
            old, new, held = table[r, h].tolist(), slots[r, h].tolist(), victims[r, h].tolist()
            evict, source = (t.tolist() for t in unpack_victim_op(new_ops[b, h]))
            read = {e for e in source if e >= 0}
            for s, (o, n) in enumerate(zip(old, new)):
                if n == o or n == -1:
                    assert new_ops[b, h, s] == 0
                    continue
                assert source[s] == (held.index(n) if n in held else -1)
                if o != -1 and evict[s] >= 0:
                    assert evict[s] not in read and new_v[r, h, evict[s]] == o
            assert not (set(new) - {-1}) & (set(new_v[r, h].tolist()) - {-1})
    for b, r in enumerate(req_slots.tolist()):
        if r != pad:  # every head: in the later phase the earlier phase's ops count where their codes are this phase's
            hits += int(((codes[b] == phase) & (unpack_victim_op(new_ops[b])[1] >= 0)).sum())
    assert stats[1 + phase] == [11.0, 13.0][phase - 1] + hits and stats[2 - phase + 2] == [11.0, 13.0][2 - phase]


@pytest.mark.parametrize("extra", [0, 5])
def test_victim_entries_fill_free_first_then_oldest(extra):
    """Three evictions (slot order) into entries [page 9 stamp 4, free, page 8 stamp 2, page 7 stamp 2] of which an
    incoming page reads entry 3 (a hit: freed, not written): the free entry 1, then the oldest, entry 2, then
    entry 0; the new stamps follow the clock (5, or 10 past `extra` younger entries, which stay as they were)."""
    dev = device()
    scores = torch.full((1, 1, 40), float("-inf"))
    scores[0, 0, [4, 5, 7]] = torch.tensor([3.0, 2.0, 1.0])  # selects 4, 5 and the victim page 7
    table = torch.tensor([[[1, 2, 3]]], dtype=torch.int32)  # all three change; 1 and 2 are evicted in slot order
    victims = torch.tensor([[[9, -1, 8, 7] + list(range(20, 20 + extra))]], dtype=torch.int32)
    age = torch.tensor([[[4, -1, 2, 2] + [9] * extra]], dtype=torch.int32)
    clock = 10 if extra else 5
    ops = torch.zeros(1, 1, 3, dtype=torch.int32)
    recall = torch.zeros(1, 1, 3, dtype=torch.int8)
    args = [t.to(dev) for t in (scores, table, torch.tensor([0], dtype=torch.int32), torch.ones(1, 1, dtype=torch.bool),
                                torch.ones(1, 1, dtype=torch.bool), recall, victims, age, ops)]
    for fn in (naive_select_slots, select_slots):
        slots, codes, stats, v, a, o = (t.cpu() for t in run(fn, *args, PHASE_NOW, -1))
        assert slots[0, 0].tolist() == [4, 5, 7]
        assert v[0, 0].tolist() == [3, 1, 2, -1] + list(range(20, 20 + extra))
        assert a[0, 0].tolist() == [clock + 2, clock, clock + 1, -1] + [9] * extra
        assert o[0, 0].tolist() == [victim_op(1, -1), victim_op(2, -1), victim_op(0, 3)]
        assert stats.tolist() == [5.0 + 3, 7.0, 11.0 + 1, 13.0]
