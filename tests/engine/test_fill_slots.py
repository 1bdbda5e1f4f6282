"""engine.fill_slots: a prompt's slots selected with its last query and filled at the end of its prefill, from the host
arena or from the GPU pages it was staged in, so that the first decode step starts like any later one."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from freekv_sglang.calibration import calibrate_synthetic, gaussian_sample
from freekv_sglang.config import FreeKVConfig
from freekv_sglang.engine import FreeKVEngine, ModelShape
from freekv_kernels.testing import device

DEV = device()
D, L, H = 32, 3, 2  # head dim 32: the channel sketch codes 32 channels


def engine(cfg, G, backend=None):  # None: Triton on a GPU, the torch references on CPU
    e = FreeKVEngine(cfg, ModelShape(L, H * G, H, D), max_requests=4, max_context=1024, dtype=torch.float32,
                     device=DEV, backend=backend)
    calibrate_synthetic(e, gaussian_sample(e))
    return e


def prompts(lens, G):
    """Per prompt and layer: K, V [n, H, D] and the last query [H * G, D]."""
    return [[(torch.randn(n, H, D, device=DEV), torch.randn(n, H, D, device=DEV), torch.randn(H * G, D, device=DEV))
             for _ in range(L)] for n in lens]


def prefill(e, data):
    slots = []
    for layers in data:
        s = e.add_request()
        e.begin_prefill(s, layers[0][0].shape[0])
        for layer, (k, v, q) in enumerate(layers):
            e.prefill_layer(s, layer, k, v, q)
        slots.append(s)
    return slots


CFG = FreeKVConfig(selection="sketch", budget=96, sink=16, window=32, page_size=16, tau=0.99, dense_layers=1)
LENS = [300, 90, 130]  # more candidates than slots; fewer; as many as k (3) plus one


@pytest.mark.parametrize("selection", ["sketch", "rerank", "means", "channels"])
@pytest.mark.parametrize("G", [1, 3, 4, 8])
def test_a_filled_first_step_recalls_nothing_and_attends_as_one_that_selects(selection, G):
    """q_1 = q_last: no head is flagged (tau below 1), so the filled engine recalls nothing before attention, and it
    attends exactly like an engine left empty, whose first step selects every head with q_1 and recalls it all."""
    cfg = dataclasses.replace(CFG, selection=selection)
    data = prompts(LENS, G)
    filled, empty = engine(cfg, G), engine(cfg, G)
    slots = prefill(filled, data)
    assert prefill(empty, data) == slots
    filled.fill_slots(slots)
    assert (filled.slot_table[1:, slots] >= 0).any(-1).all()  # every sparse head holds pages
    assert (filled.slot_table[0, slots] == -1).all()  # the dense layer none
    kv = torch.randn(2, L, len(slots), H, D, device=DEV)
    outs = []
    for e in (filled, empty):
        plan = e.begin_step(slots)
        outs.append([e.attend(plan, layer, torch.stack([d[layer][2] for d in data]), kv[0, layer], kv[1, layer])
                     for layer in range(L)])
        e.end_step()
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert torch.equal(filled.slot_table, empty.slot_table)
    assert filled.stats()["recall_pages_now"] == 0 == filled.stats()["flagged"]
    assert empty.stats()["recall_pages_now"] > 0


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_filling_from_staging_equals_recalling_from_the_host(backend):
    """The same prompts staged in a paged buffer at scattered pages: the slots hold the bytes a recall would bring."""
    G, p = 3, CFG.page_size
    data = prompts(LENS, G)
    a, b = engine(CFG, G, backend), engine(CFG, G, backend)
    slots = prefill(a, data)
    prefill(b, data)
    W = max(-(-n // p) for n in LENS)
    order = torch.randperm(len(LENS) * W, device=DEV)
    pages = order.view(len(LENS), W)  # staging page of each logical page
    bufs = [torch.full((len(LENS) * W * p + p, H, D), float("nan"), device=DEV) for _ in range(2 * L)]
    for i, layers in enumerate(data):
        for layer, (k, v, _) in enumerate(layers):
            n = k.shape[0]
            rows = (pages[i, :-(-n // p)][:, None] * p + torch.arange(p, device=DEV)).flatten()[:n]
            bufs[2 * layer][rows], bufs[2 * layer + 1][rows] = k, v
    a.fill_slots(slots, staged=(lambda layer: (bufs[2 * layer], bufs[2 * layer + 1]), pages))
    b.fill_slots(slots)
    assert torch.equal(a.slot_table, b.slot_table)
    plan = a.begin_step(slots)
    for layer in range(1, L):
        held = plan.slot_pages[:, None, :].expand(-1, H, -1)[a.slot_table[layer][plan.req_slots.long()] >= 0]
        for x, y in ((a.k_cache[layer], b.k_cache[layer]), (a.v_cache[layer], b.v_cache[layer])):
            xs, ys = x.view(-1, p, H, D), y.view(-1, p, H, D)
            assert torch.equal(xs[held.long()], ys[held.long()])
            assert not xs[held.long()].isnan().any()


def test_refusals_and_policies_without_speculation():
    e = engine(CFG, 2)
    slots = prefill(e, prompts([200], 2))
    with pytest.raises(ValueError, match="not in use"):
        e.fill_slots([3])
    with pytest.raises(ValueError, match="one row per slot"):
        e.fill_slots(slots, staged=(None, torch.zeros(2, 13, dtype=torch.int64, device=DEV)))
    louis = FreeKVEngine(dataclasses.replace(CFG, retrieval="louiskv", selection="means"),
                         ModelShape(L, 2 * H, H, D), max_requests=2, max_context=1024, dtype=torch.float32, device=DEV)
    assert not louis.fills_at_prefill
    s = prefill(louis, prompts([200], 2))
    louis.fill_slots(s)
    assert (louis.slot_table == -1).all()
