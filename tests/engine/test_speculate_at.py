"""cfg.speculate_at "next_recall": a sparse layer's speculative selection waits for the next sparse layer's selection
before attention; the selections, recalls and outputs stay those of "attention"."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

from freekv_kernels.page_select.naive import PHASE_LATER, PHASE_NOW
from freekv_kernels.testing import device
from freekv_sglang.config import FreeKVConfig
from freekv_sglang.engine import FreeKVEngine, ModelShape

DEV = device()
CFG = FreeKVConfig(budget=48, sink=16, window=16, page_size=16, tau=0.05, dense_layers=1, victim=32)


def make_engine(cfg: FreeKVConfig, L: int = 4) -> FreeKVEngine:
    shape = ModelShape(num_layers=L, num_q_heads=6, num_kv_heads=2, head_dim=32)
    return FreeKVEngine(cfg, shape, max_requests=3, max_context=1024, dtype=torch.float32, device=DEV,
                        backend="torch")


@pytest.mark.parametrize("selection", ["channels", "means"])
def test_next_recall_selects_and_attends_as_attention(selection, prefill_alike, decode_alike):
    """Step by step the same outputs, slot tables and statistics (recalls and victim hits included) over decode steps
    that offload pages and reselect."""
    cfg = dataclasses.replace(CFG, selection=selection)
    engines = [make_engine(dataclasses.replace(cfg, speculate_at=at)) for at in ("attention", "next_recall")]
    torch.manual_seed(11)
    stats = decode_alike(engines, prefill_alike(engines, [200, 90], device=DEV), 20, device=DEV)
    assert stats["recall_pages_speculative"] > 0 and stats["recall_pages_now"] > 0 and stats["flagged"] > 0


def _phases(monkeypatch, eng: FreeKVEngine, prefill_alike) -> list[tuple]:
    """(layer, phase) of every selection of one decode step, with ('end',) where end_step returns."""
    seen, select = [], eng._select
    monkeypatch.setattr(eng, "_select", lambda plan, layer, q, phase, *a: (seen.append((layer, phase)),
                                                                          select(plan, layer, q, phase, *a)))
    slots = prefill_alike([eng], [150], device=DEV)
    shape = eng.shape
    plan = eng.begin_step(slots)
    seen.clear()  # the prefill's fill
    for layer in range(shape.num_layers):
        eng.attend(plan, layer, torch.randn(1, shape.num_q_heads, shape.head_dim, device=DEV),
                   *torch.randn(2, 1, shape.num_kv_heads, shape.head_dim, device=DEV))
    eng.end_step()
    return seen + [("end",)]


def test_next_recall_moves_the_speculative_selection_after_the_next_layers(monkeypatch, prefill_alike):
    """Layer l's speculative selection follows layer l + 1's selection before attention; the last sparse layer's
    follows its own attention; none is left past end_step."""
    order = _phases(monkeypatch, make_engine(dataclasses.replace(CFG, speculate_at="next_recall"), L=5),
                    prefill_alike)
    assert order == [(1, PHASE_NOW), (2, PHASE_NOW), (1, PHASE_LATER), (3, PHASE_NOW), (2, PHASE_LATER),
                     (4, PHASE_NOW), (3, PHASE_LATER), (4, PHASE_LATER), ("end",)]
    order = _phases(monkeypatch, make_engine(dataclasses.replace(CFG, speculate_at="attention"), L=5), prefill_alike)
    assert order == [(1, PHASE_NOW), (1, PHASE_LATER), (2, PHASE_NOW), (2, PHASE_LATER), (3, PHASE_NOW),
                     (3, PHASE_LATER), (4, PHASE_NOW), (4, PHASE_LATER), ("end",)]


@pytest.mark.parametrize("at", ["attention", "next_recall"])
def test_the_last_sparse_layers_speculative_lane_runs_on_the_select_stream(monkeypatch, prefill_alike, at):
    """The step's join waits for the last sparse layer's speculative selection, recall and offload, which no later
    layer hides, so they run on the select stream at the critical chain's priority, the recall with one program per
    slot; the other layers' on the speculate and recall streams, their recall with recall_programs."""
    eng = make_engine(dataclasses.replace(CFG, speculate_at=at, recall_programs=7), L=4)
    lane, on = [None], eng.streams.on

    @contextlib.contextmanager
    def tracked(name):
        outer, lane[0] = lane[0], name
        with on(name):
            yield
        lane[0] = outer

    monkeypatch.setattr(eng.streams, "on", tracked)
    lanes, select, recall, offload = {}, eng._select, eng._recall_phase, eng._offload
    monkeypatch.setattr(eng, "_select", lambda plan, layer, q, phase, *a: (
        lanes.__setitem__(("select", layer, phase), lane[0]), select(plan, layer, q, phase, *a)))
    monkeypatch.setattr(eng, "_recall_phase", lambda plan, layer, phase, programs=0: (
        lanes.__setitem__(("recall", layer, phase), (lane[0], programs)), recall(plan, layer, phase, programs)))
    monkeypatch.setattr(eng, "_offload", lambda layer, *a: (lanes.__setitem__(("offload", layer), lane[0]),
                                                            offload(layer, *a)))
    _phases(monkeypatch, eng, prefill_alike)
    assert lanes == {
        **{("select", layer, PHASE_NOW): "select" for layer in (1, 2, 3)},
        **{("recall", layer, PHASE_NOW): ("select", 0) for layer in (1, 2, 3)},
        ("select", 1, PHASE_LATER): "speculate", ("select", 2, PHASE_LATER): "speculate",
        ("select", 3, PHASE_LATER): "select",
        ("recall", 1, PHASE_LATER): ("recall", 7), ("recall", 2, PHASE_LATER): ("recall", 7),
        ("recall", 3, PHASE_LATER): ("select", 0),
        ("offload", 1): "recall", ("offload", 2): "recall", ("offload", 3): "select"}


def test_a_step_cut_short_flushes_at_end_step(monkeypatch, prefill_alike):
    """A caller that ends the step before the last layer (no next sparse layer comes) still gets the deferred
    layer's speculative selection, before end_step returns."""
    eng = make_engine(CFG)  # next_recall by default
    seen, select = [], eng._select
    monkeypatch.setattr(eng, "_select", lambda plan, layer, q, phase, *a: (seen.append((layer, phase)),
                                                                          select(plan, layer, q, phase, *a)))
    slots = prefill_alike([eng], [150], device=DEV)
    shape, plan = eng.shape, eng.begin_step(slots)
    seen.clear()
    for layer in range(2):
        eng.attend(plan, layer, torch.randn(1, shape.num_q_heads, shape.head_dim, device=DEV),
                   *torch.randn(2, 1, shape.num_kv_heads, shape.head_dim, device=DEV))
    assert seen == [(1, PHASE_NOW)]
    eng.end_step()
    assert seen == [(1, PHASE_NOW), (1, PHASE_LATER)]


def test_speculate_at_is_checked():
    with pytest.raises(ValueError, match="speculate_at must be one of attention, next_recall"):
        FreeKVConfig(speculate_at="later")
