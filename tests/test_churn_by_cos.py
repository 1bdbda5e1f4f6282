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


def test_cases_fall_in_their_cosine_bucket(monkeypatch):
    plan = SimpleNamespace(req_slots=torch.tensor([0]), cand_end=torch.tensor([N]))
    mass0 = torch.tensor([[5, 4, 0, 0, 0, 0], [5, 4, 0, 0, 0, 0]], dtype=torch.float)
    mass1 = torch.tensor([[5, 4, 0, 0, 0, 0], [0, 0, 0, 0, 5, 4]], dtype=torch.float)  # head 1's top pages all move
    probe = probe_with(monkeypatch, [mass0, mass0, mass1])
    q0 = torch.zeros(1, H * G * D)
    q0[0, :] = 1.0
    q1 = q0.clone().view(1, H, G, D)
    q1[0, 1, :, : D // 2] = -1.0  # head 1 turns (cosine 0); head 0 stays (cosine 1)
    slots0 = torch.tensor([[[0, 1], [0, 1]]])
    slots1 = torch.tensor([[[0, 1], [4, 5]]])  # head 1's selection follows its new top pages
    probe(1, plan, q0, slots0)  # the first call keeps the queries and top pages only
    probe(1, plan, q0, slots0)  # counted: nothing turned, nothing changed; the selection is now on record
    probe(1, plan, q1.view(1, -1), slots1)
    buckets = probe.by_cos()
    assert len(buckets) == len(COS_EDGES) + 1
    low, top = buckets[0], buckets[-1]
    assert low["share"] == pytest.approx(0.25) and top["share"] == pytest.approx(0.75)
    assert low["oracle_change"] == pytest.approx(1.0) and top["oracle_change"] == pytest.approx(0.0)
    assert low["changed_share"] == pytest.approx(1.0) and low["unchanged"] == pytest.approx(0.0)
    assert top["changed_share"] == pytest.approx(0.0) and top["unchanged"] == pytest.approx(1.0)  # head 0, step 3
    assert all(b["share"] == 0 for b in buckets[1:-1])
