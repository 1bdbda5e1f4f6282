"""Torch references for page scoring, top-k selection and slot assignment (see docs/kernels.md)."""

from __future__ import annotations

import math

import torch

POOLINGS = ("mean_softmax", "max")
# The engine's two selection phases: heads[b, h] True selects before attention, False after it.
PHASE_NOW, PHASE_LATER = 1, 2
# A victim op packs, per (row, head, slot), the victim entry a recall evicts the slot's page into and the entry it
# takes the incoming page from, each plus one (0: none), in the low and high 16 bits of an int32.
VICTIM_SHIFT = 16
MAX_VICTIM_ENTRIES = (1 << 15) - 2  # the high field stays below the int32 sign bit


def victim_op(evict: int, source: int) -> int:
    """The packed op of one recall item: evict into entry `evict`, take the page from entry `source` (-1: none)."""
    return (evict + 1) | ((source + 1) << VICTIM_SHIFT)


def unpack_victim_op(op: torch.Tensor | int) -> tuple:
    """(evict, source) of packed ops, -1 for none."""
    return (op & ((1 << VICTIM_SHIFT) - 1)) - 1, (op >> VICTIM_SHIFT) - 1


def check_phase(phase: int) -> None:
    if phase not in (PHASE_NOW, PHASE_LATER):
        raise ValueError(f"phase must be {PHASE_NOW} (now) or {PHASE_LATER} (later), got {phase!r}")


def check_hysteresis(hysteresis: float) -> None:
    if isinstance(hysteresis, bool) or not isinstance(hysteresis, (int, float)) or not 0.0 <= hysteresis < math.inf:
        raise ValueError(f"hysteresis must be a finite number >= 0, got {hysteresis!r}")


def resident_factor(hysteresis: float) -> torch.Tensor:
    """The fp32 factor (1 + hysteresis) by which a resident page's score counts in its head's top-k."""
    return torch.tensor(1.0 + hysteresis, dtype=torch.float32)


def in_phase(heads: torch.Tensor | None, phase: int) -> torch.Tensor | None:
    """[B, H] bool: the heads that select in `phase` (None: every head)."""
    check_phase(phase)
    return None if heads is None else heads == (phase == PHASE_NOW)


def naive_score_pages(
    q: torch.Tensor,
    summaries: torch.Tensor,
    page_table: torch.Tensor,
    req_slots: torch.Tensor,
    cand_start: int,
    cand_end: torch.Tensor,
    scale: float,
    pooling: str = "mean_softmax",
    heads: torch.Tensor | None = None,
    phase: int = PHASE_NOW,
    q_by_slot: bool = False,
) -> torch.Tensor:
    """Rows of the heads that do not select in `phase` are left unwritten (NaN here)."""
    if pooling not in POOLINGS:
        raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
    mine = in_phase(heads, phase)
    B, H = req_slots.shape[0], summaries.shape[1]
    G = q.shape[1] // H
    M = page_table.shape[1]
    scores = torch.full((B, H, M), float("nan"), dtype=torch.float32, device=q.device)
    for b, slot in enumerate(req_slots.tolist()):
        qb = q[slot if q_by_slot else b]
        end = min(int(cand_end[b]), M)
        for h in range(H):
            if mine is not None and not mine[b, h]:
                continue
            scores[b, h] = float("-inf")
            if end <= cand_start:
                continue
            pages = page_table[slot, cand_start:end].long()
            kmin = summaries[pages, h, 0].float()  # [n, D]
            kmax = summaries[pages, h, 1].float()
            qh = qb[h * G:(h + 1) * G].float()[:, None]  # [G, 1, D]
            s = scale * torch.maximum(qh * kmin, qh * kmax).sum(-1)  # [G, n]
            pooled = s.amax(dim=0) if pooling == "max" else torch.softmax(s, dim=-1).mean(dim=0)
            scores[b, h, cand_start:end] = pooled
    return scores


def _top_k(scores: torch.Tensor, k: int) -> list[int]:
    """The k best pages of one row of scores, best first, ties by the lower page id; -1 for -inf or missing."""
    vals, idx = torch.sort(scores, descending=True, stable=True)  # stable: ties keep the lower page first
    top = [j if v != float("-inf") else -1 for v, j in zip(vals[:k].tolist(), idx[:k].tolist())]
    return top + [-1] * (k - len(top))


def _slot_delta(old: list[int], sel: list[int]) -> list[int]:
    """Resident pages stay in their slot; the selected pages not resident fill the other slots in selection
    order, in increasing slot order; slots left over get -1."""
    wanted = {p for p in sel if p != -1}
    kept = [p if p in wanted else -1 for p in old]
    incoming = iter([p for p in sel if p != -1 and p not in kept])
    return [p if p != -1 else next(incoming, -1) for p in kept]


def check_victims(victims: torch.Tensor | None, victim_age: torch.Tensor | None, victim_ops: torch.Tensor | None,
                  slots: torch.Tensor, recall: torch.Tensor, recall_all: bool) -> bool:
    """Whether a select_slots call keeps a victim cache; its three tensors come together, shaped after slots."""
    given = [t is not None for t in (victims, victim_age, victim_ops)]
    if not any(given):
        return False
    if not all(given):
        raise ValueError("victims, victim_age and victim_ops come together")
    if recall_all:
        raise ValueError("recall_all re-recalls every selected page: a victim cache has nothing to save there")
    R, H = slots.shape[:2]
    V = victims.shape[2]
    assert victims.shape == victim_age.shape == (R, H, V) and 1 <= V <= MAX_VICTIM_ENTRIES
    assert victims.dtype == victim_age.dtype == victim_ops.dtype == torch.int32 and victim_ops.shape == recall.shape
    return True


def _victim_moves(old: list[int], new: list[int], entries: list[int], age: list[int]) -> tuple[list, list, list]:
    """One head's victim ops for the slot change old -> new, and its victim table afterwards.

    An incoming page that an entry holds comes from that entry (a hit), which is then freed. Each outgoing page, in
    slot order, goes to the next entry among those no hit reads in this change (so no entry is written and read by
    one recall launch), free ones first, then the oldest (ages are insertion stamps, ties by entry); an outgoing page
    finding no such entry is dropped."""
    V = len(entries)
    source = [entries.index(n) if n != o and n != -1 and n in entries else -1 for n, o in zip(new, old)]
    read = {e for e in source if e >= 0}
    eligible = sorted((e for e in range(V) if e not in read), key=lambda e: (entries[e] != -1, age[e], e))
    clock = max(age) + 1
    entries, age = [(-1 if e in read else p) for e, p in enumerate(entries)], [(-1 if e in read else a)
                                                                               for e, a in enumerate(age)]
    evict, j = [-1] * len(old), 0
    for s, (n, o) in enumerate(zip(new, old)):
        if n != o and n != -1 and o != -1:
            if j < len(eligible):
                e = eligible[j]
                evict[s], entries[e], age[e] = e, o, clock + j
            j += 1
    return [victim_op(e, src) if n != o and n != -1 else 0 for e, src, n, o in zip(evict, source, new, old)], \
        entries, age


def naive_select_slots(
    scores: torch.Tensor,
    slots: torch.Tensor,
    req_slots: torch.Tensor,
    heads: torch.Tensor,
    phase: int,
    flags: torch.Tensor | None,
    recall: torch.Tensor,
    recall_all: bool = False,
    stats: torch.Tensor | None = None,
    pad_slot: int = -1,
    hysteresis: float = 0.0,
    victims: torch.Tensor | None = None,
    victim_age: torch.Tensor | None = None,
    victim_ops: torch.Tensor | None = None,
    scratch: bool = False,
) -> None:
    """Top-k selection, slot assignment and commit for the heads of `phase`, and the recall plan of every head.

    Per (row b, KV head h), with r = req_slots[b] and old = slots[r, h]: a head of the phase selects the top
    k = slots.shape[2] pages of scores[b, h] after the scores of the pages of old are multiplied by (1 + hysteresis)
    in place (fp32; scores are non-negative attention masses, so a page must outscore a resident one by that factor
    to displace it), and stores them in slots[r, h] (resident pages keep their slot);
    a slot is changed when it now holds a page it did not (recall_all: every filled slot of the head).
    PHASE_NOW: recall[b, h, s] = PHASE_NOW for changed slots of flagged heads or slots that were empty,
    PHASE_LATER for the other changed slots, 0 elsewhere -- for every head. PHASE_LATER: the phase's heads
    set recall[b, h] = PHASE_LATER where changed, 0 elsewhere; the other heads' entries stay.
    stats ([2] or [4] float64), for rows with r != pad_slot: stats[phase - 1] += entries equal to `phase` afterwards;
    with 4 entries also stats[1 + phase] += those of them whose victim op takes the page from a victim entry.
    A victim cache (victims, victim_age [R, H, V] int32: the logical page each of V entries holds, -1 empty, and its
    insertion stamp; victim_ops [B, H, k] int32, see victim_op): a phase's head of a row other than pad_slot updates
    its entries as _victim_moves says and writes victim_ops[b, h] (0 where no slot changes); the other heads' ops
    stay, as their recall codes do. Not with recall_all.
    scratch: the scores are the caller's scratch, which the kernel may overwrite after its top-k (they then hold no
    scores); here they stay as the hysteresis leaves them.
    """
    check_hysteresis(hysteresis)
    cached = check_victims(victims, victim_age, victim_ops, slots, recall, recall_all)
    mine = in_phase(heads, phase).tolist()
    flagged = flags.tolist() if phase == PHASE_NOW else None
    k = slots.shape[2]
    for b, r in enumerate(req_slots.tolist()):
        for h in range(slots.shape[1]):
            old = slots[r, h].tolist()
            new = old
            if mine[b][h]:
                if hysteresis:
                    held = torch.tensor([p for p in old if p >= 0], dtype=torch.long, device=scores.device)
                    scores[b, h, held] = scores[b, h, held] * resident_factor(hysteresis).to(scores.device)
                new = _slot_delta(old, _top_k(scores[b, h], k))
                slots[r, h] = torch.tensor(new, dtype=slots.dtype)
                if cached:
                    ops, entries, age = ([0] * k, None, None) if r == pad_slot else \
                        _victim_moves(old, new, victims[r, h].tolist(), victim_age[r, h].tolist())
                    victim_ops[b, h] = torch.tensor(ops, dtype=torch.int32)
                    if entries is not None:
                        victims[r, h] = torch.tensor(entries, dtype=torch.int32)
                        victim_age[r, h] = torch.tensor(age, dtype=torch.int32)
            changed = [mine[b][h] and n != -1 and (recall_all or n != o) for n, o in zip(new, old)]
            if phase == PHASE_NOW:
                codes = [(PHASE_NOW if flagged[b][h] or o < 0 else PHASE_LATER) if c else 0 for c, o in zip(changed, old)]
                recall[b, h] = torch.tensor(codes, dtype=recall.dtype)
            elif mine[b][h]:
                recall[b, h] = torch.tensor([PHASE_LATER if c else 0 for c in changed], dtype=recall.dtype)
            if stats is not None and r != pad_slot:
                stats[phase - 1] += int((recall[b, h] == phase).sum())
                if stats.shape[0] == 4 and cached:
                    hits = (recall[b, h] == phase) & (unpack_victim_op(victim_ops[b, h])[1] >= 0)
                    stats[1 + phase] += int(hits.sum())
