"""A decode step captured in a CUDA graph replays exactly like eager decoding (GPU only)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from freekv_kernels.page_select import PHASE_NOW

from freekv_sglang.config import FreeKVConfig
from freekv_sglang.engine import FreeKVEngine, ModelShape

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


# louiskv: tau is its boundary_tau. next_recall: the graphed engine's speculative selections wait for the next layer's
# selection before attention (cross-stream edges of the graph), the eager one's do not.
@pytest.mark.parametrize("retrieval, speculate_at",
                         [("freekv", "attention"), ("freekv", "next_recall"), ("louiskv", "attention")])
@pytest.mark.parametrize("tau", [0.0, 0.8, 1.0])
def test_graph_replay_equals_eager(tau, retrieval, speculate_at, prefill_alike):
    H, G, D, L, bs = 2, 4, 64, 3, 4
    cfg = FreeKVConfig(budget=64, sink=32, window=32, page_size=32, tau=tau, dense_layers=1, retrieval=retrieval,
                       boundary_tau=tau, selection="sketch", speculate_at="attention")
    shape = ModelShape(L, H * G, H, D)
    engines = [FreeKVEngine(c, shape, max_requests=bs, max_context=2048, dtype=torch.bfloat16, device="cuda",
                            backend="triton") for c in (cfg, dataclasses.replace(cfg, speculate_at=speculate_at))]
    eager, graphed = engines
    lens = [700, 1031, 300]  # 3 real rows in a bucket of 4: one padding row
    slots = prefill_alike(engines, lens, dtype=torch.bfloat16, device="cuda")

    q = torch.zeros(L, bs, H * G, D, device="cuda", dtype=torch.bfloat16)
    k = torch.zeros(L, bs, H, D, device="cuda", dtype=torch.bfloat16)
    v = torch.zeros_like(k)

    def step(e, batch):
        plan = e.plan(batch)
        out = torch.stack([e.attend(plan, layer, q[layer, :batch], k[layer, :batch], v[layer, :batch])
                           for layer in range(L)])
        e.end_step()
        return out

    # Warm up (compiles the kernels) and capture on an all-padding batch: no real request moves.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        graphed.prepare_step([], pad_to=bs)
        step(graphed, bs)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    graphed.prepare_step([], pad_to=bs)
    with torch.cuda.graph(graph):
        static_out = step(graphed, bs)

    for _ in range(40):
        q.normal_(), k.normal_(), v.normal_()
        ref = torch.stack([eager.attend(plan, layer, q[layer, :3], k[layer, :3], v[layer, :3])
                           for plan in [eager.begin_step(slots)] for layer in range(L)])
        eager.end_step()
        graphed.prepare_step(slots, pad_to=bs)
        graph.replay()
        torch.testing.assert_close(static_out[:, :3], ref, atol=2e-2, rtol=2e-2)
    se, sg = eager.stats(), graphed.stats()
    assert se["recall_bytes_now"] == sg["recall_bytes_now"]
    assert se["recall_bytes_speculative"] == sg["recall_bytes_speculative"]


def test_step_timing_inside_a_graph(prefill_alike):
    """With step timing on, a replayed graph re-records the timing events: every step's times are its own."""
    H, G, D, L, bs = 2, 4, 64, 3, 2
    cfg = FreeKVConfig(budget=64, sink=32, window=32, page_size=32, tau=1.0, dense_layers=1, selection="sketch")
    e = FreeKVEngine(cfg, ModelShape(L, H * G, H, D), max_requests=bs, max_context=2048, dtype=torch.bfloat16,
                     device="cuda", backend="triton")
    assert e.enable_step_timing() and e.step_times() is None  # nothing ran yet
    slots = prefill_alike([e], [900, 1200], dtype=torch.bfloat16, device="cuda")
    q = torch.randn(L, bs, H * G, D, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(L, bs, H, D, device="cuda", dtype=torch.bfloat16)

    def step():
        plan = e.plan(bs)
        for layer in range(L):
            e.attend(plan, layer, q[layer], kv[layer], kv[layer])
        e.end_step()

    e.prepare_step(slots)
    step()  # eager: compiles, and times
    eager = e.step_times()
    assert set(eager) == {"selection", "recall"}
    for kind in eager.values():
        assert set(kind) == {"before_attention", "speculative"} and all(t > 0 for t in kind.values())
    graph = torch.cuda.CUDAGraph()
    e.prepare_step(slots)
    with torch.cuda.graph(graph):
        step()
    seen = []
    for _ in range(3):
        e.prepare_step(slots)
        graph.replay()
        t = e.step_times()
        assert all(x > 0 for kind in t.values() for x in kind.values())
        seen.append(t["selection"]["before_attention"])
    assert len(set(seen)) > 1, "the replays did not record the timing events again"


def test_step_timing_of_sampled_layers(prefill_alike):
    """A timer over one of two sparse layers (the deeper: the middle of [1, 2]) scales its times by two, and records
    nothing in the other layer."""
    H, G, D, L = 2, 4, 64, 3
    cfg = FreeKVConfig(budget=64, sink=32, window=32, page_size=32, tau=1.0, dense_layers=1, selection="sketch")
    e = FreeKVEngine(cfg, ModelShape(L, H * G, H, D), max_requests=1, max_context=2048, dtype=torch.bfloat16,
                     device="cuda", backend="triton")
    assert e.enable_step_timing(sample_layers=1) and e.timer.layers == {2} and e.timer.scale == 2
    slots = prefill_alike([e], [1500], dtype=torch.bfloat16, device="cuda")
    q = torch.randn(L, 1, H * G, D, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(L, 1, H, D, device="cuda", dtype=torch.bfloat16)
    e.prepare_step(slots)
    plan = e.plan(1)
    for layer in range(L):
        e.attend(plan, layer, q[layer], kv[layer], kv[layer])
    e.end_step()
    assert {layer for layer, _ in e.timer._events} == {2}
    t = e.step_times()
    assert all(x > 0 for kind in t.values() for x in kind.values())
    start, selected, recalling, recalled = e.timer._events[(2, PHASE_NOW)]
    assert t["selection"]["before_attention"] == pytest.approx(2 * start.elapsed_time(selected) / 1e3)
    assert t["recall"]["before_attention"] == pytest.approx(2 * recalling.elapsed_time(recalled) / 1e3)
