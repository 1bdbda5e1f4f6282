"""benchmarks/realistic_churn.py's ChurnProbe on a hand-made engine: each (KV head, step) case lands in the bucket of
its adjacent queries' group-mean cosine, with the oracle's top-k change and the selection's change counted there."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import realistic_churn  # noqa: E402
from realistic_churn import COS_EDGES, ChurnProbe  # noqa: E402

H, G, D, K, N = 2, 2, 8, 2, 6  # KV heads, group, head dim, budget pages, candidate pages


def probe_with(monkeypatch, masses):
    """A probe on an engine of one request whose page attention mass is masses[i] at the i-th call."""
    engine = SimpleNamespace(cfg=SimpleNamespace(select_pages=K, sink_pages=0),
                             shape=SimpleNamespace(num_kv_heads=H, group=G, head_dim=D), max_pages=N, pad_slot=-1,
                             tau=0.9)
    calls = iter(masses)
    monkeypatch.setattr(realistic_churn, "page_attention_mass", lambda *a: next(calls))
    probe = ChurnProbe(engine)
    probe.active = True
    return probe


def queries(*per_head):
    """One request's query [1, H*G*D]: per KV head a vector of D, the same for each query head of its group."""
    return torch.stack([torch.tensor(v, dtype=torch.float).expand(G, D) for v in per_head])[None].reshape(1, -1)


def unit(*coords):
    v = [0.0] * D
    for i, c in coords:
        v[i] = c
    return v


def test_cases_fall_in_their_cosine_bucket(monkeypatch):
    plan = SimpleNamespace(req_slots=torch.tensor([0]), cand_end=torch.tensor([N]))
    still = [5, 4, 0, 0, 0, 0]
    masses = [torch.tensor([still, still]), torch.tensor([still, still]),
              torch.tensor([still, [0, 0, 0, 0, 5, 4]]),  # head 1's best pages all move
              torch.tensor([still, [0, 0, 0, 4, 5, 0]])]  # one of them moves again
    probe = probe_with(monkeypatch, [m.float() for m in masses])
    e0, e1 = unit((0, 1.0)), unit((1, 1.0))
    calls = [(queries(e0, e0), [[0, 1], [0, 1]]),  # kept: the queries and best pages only
             (queries(e0, e0), [[0, 1], [0, 1]]),  # counted; the selection is now on record
             (queries(e0, e1), [[0, 2], [4, 5]]),  # head 1 turns (cosine 0); head 0 stays but one page changes
             (queries(e0, unit((1, 0.96), (2, 0.28))), [[0, 2], [4, 3]])]  # head 1 at cosine 0.96
    for q, slots in calls:
        probe(1, plan, q, torch.tensor([slots]))
    buckets = probe.by_cos()
    assert len(buckets) == len(COS_EDGES) + 1
    assert [b["cos_from"] for b in buckets] == [-1.0, *COS_EDGES]
    low, mid, top = buckets[0], buckets[2], buckets[-1]
    assert (mid["cos_from"], mid["cos_to"]) == (0.95, 0.98)
    assert [b["share"] for b in buckets] == pytest.approx([1 / 6, 0, 1 / 6, 0, 0, 4 / 6])
    assert low["oracle_change"] == pytest.approx(1.0) and mid["oracle_change"] == pytest.approx(0.5)
    assert top["oracle_change"] == pytest.approx(0.0)
    # The selection's change counts from the third call on (the second only records what was attended).
    assert low["changed_share"] == pytest.approx(1.0) and low["unchanged"] == pytest.approx(0.0)
    assert mid["changed_share"] == pytest.approx(0.5) and mid["unchanged"] == pytest.approx(0.0)
    assert top["changed_share"] == pytest.approx(0.25) and top["unchanged"] == pytest.approx(0.5)
