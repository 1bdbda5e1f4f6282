"""tsp_engines: FastKV's later layers in an engine that writes into the earlier layers' host pages.

The late engine must decode exactly as an engine of its own (own host pool, own page table) fed the same compacted
sequence, allocate no host page, write only its own layers of the shared pages, and refuse to outgrow the engine
whose pages it uses.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from freekv_sglang.config import FreeKVConfig
from freekv_sglang.engine import FreeKVEngine, ModelShape, tsp_engines
from freekv_sglang.host_pool import LayerSlice, LocalHostPool
from freekv_kernels.testing import device

DEV = device()
L, HQ, H, D, P = 4, 6, 2, 16, 16
SHAPE = ModelShape(L, HQ, H, D)
# Head dim 16: below the default channel sketch's 32 channels, so the sketch selects.
CFG = FreeKVConfig(selection="sketch", budget=64, sink=16, window=16, page_size=P, tau=0.7, dense_layers=1, prefill="tsp",
                   tsp_layer=1, tsp_keep=40)
CTX = 512


def make_pair(host_pages=64):
    pool = LocalHostPool(host_pages, L, H, P, D, torch.float32, pin=False)
    early, late = tsp_engines(CFG, SHAPE, pool, max_requests=3, max_context=CTX, dtype=torch.float32, device=DEV,
                              backend="torch")
    return pool, early, late


def test_the_late_engine_decodes_as_an_engine_of_its_own():
    pool, early, late = make_pair()
    alone = FreeKVEngine(dataclasses.replace(CFG, prefill="full", dense_layers=0), ModelShape(2, HQ, H, D),
                         max_requests=3, max_context=CTX, dtype=torch.float32, device=DEV, backend="torch")
    g = torch.Generator().manual_seed(0)
    lens = {200: 90, 130: 41}  # prompt -> propagated tokens
    slots = []
    for n, m in lens.items():
        s = early.add_request()
        late.add_request(s)
        a = alone.add_request(s)
        early.begin_prefill(s, n)
        for layer in range(2):
            early.prefill_layer(s, layer, torch.randn(n, H, D, generator=g).to(DEV),
                                torch.randn(n, H, D, generator=g).to(DEV))
        late.begin_prefill(s, m)
        alone.begin_prefill(a, m)
        for layer in range(2):
            k, v = torch.randn(m, H, D, generator=g).to(DEV), torch.randn(m, H, D, generator=g).to(DEV)
            late.prefill_layer(s, layer, k, v)
            alone.prefill_layer(a, layer, k, v)
        slots.append(s)
    used = pool.free_pages
    assert late._host_pages[slots[0]] is early._host_pages[slots[0]]
    for _ in range(40):  # past a page boundary of each: offloads into pages the early engine grew
        plans = [eng.begin_step(slots) for eng in (early, late, alone)]
        for layer in range(2):
            q = torch.randn(len(slots), HQ, D, generator=g).to(DEV)
            k, v = torch.randn(len(slots), H, D, generator=g).to(DEV), torch.randn(len(slots), H, D, generator=g).to(DEV)
            early.attend(plans[0], layer, torch.randn_like(q), torch.randn_like(k), torch.randn_like(v))
            want = alone.attend(plans[2], layer, q, k, v)
            got = late.attend(plans[1], layer, q, k, v)
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        for eng in (early, late, alone):
            eng.end_step()
    assert pool.free_pages < used  # the early engine grew; the late one took nothing of its own
    assert late.seq_len(slots[0]) == 90 + 40 and early.seq_len(slots[0]) == 200 + 40
    # The late engine's layers of a shared page hold its own (compacted) tokens: those of the lone engine's page.
    s, j = slots[0], CFG.sink_pages  # the first offloaded page
    torch.testing.assert_close(pool.arena[early.host_page(s, j), 2:], alone.host.arena[alone.host_page(s, j)],
                               rtol=0, atol=0)
    free = pool.free_pages
    late.remove_request(s)
    assert pool.free_pages == free and early.is_active(s)  # nothing freed by the late engine
    early.remove_request(s)
    assert pool.free_pages > free


def test_the_late_engine_cannot_outgrow_the_early_one():
    _, early, late = make_pair()
    s = early.add_request()
    late.add_request(s)
    early.begin_prefill(s, 50)
    with pytest.raises(ValueError, match="more than the engine whose host pages this one shares"):
        late.begin_prefill(s, 100)
    late.begin_prefill(s, 50)
    with pytest.raises(ValueError, match="cannot be exported or shared"):
        late.export_pages(s, 1)


def test_sharing_needs_matching_slots_and_arena():
    pool = LocalHostPool(32, L, H, P, D, torch.float32, pin=False)
    kw = dict(max_context=CTX, dtype=torch.float32, device=DEV, backend="torch")
    cfg = dataclasses.replace(CFG, prefill="full", dense_layers=0)
    early = FreeKVEngine(cfg, ModelShape(2, HQ, H, D), host_pool=LayerSlice(pool, 0, 2), max_requests=3, **kw)
    with pytest.raises(ValueError, match="slots, padding slot, max_context"):
        FreeKVEngine(cfg, ModelShape(2, HQ, H, D), host_pool=LayerSlice(pool, 2, 2), max_requests=4, pages_of=early,
                     **kw)
    other = LocalHostPool(16, L, H, P, D, torch.float32, pin=False)
    with pytest.raises(ValueError, match="view of the same arena"):
        FreeKVEngine(cfg, ModelShape(2, HQ, H, D), host_pool=LayerSlice(other, 2, 2), max_requests=3, pages_of=early,
                     **kw)
    with pytest.raises(ValueError, match="not within the arena"):
        LayerSlice(pool, 3, 2)
