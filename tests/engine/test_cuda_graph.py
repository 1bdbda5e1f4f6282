"""A decode step captured in a CUDA graph replays exactly like eager decoding (GPU only)."""

from __future__ import annotations

import pytest
import torch

from freekv_sglang.config import FreeKVConfig
from freekv_sglang.engine import FreeKVEngine, ModelShape

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


@pytest.mark.parametrize("retrieval", ["freekv", "louiskv"])  # louiskv: tau is its boundary_tau
@pytest.mark.parametrize("tau", [0.0, 0.8, 1.0])
def test_graph_replay_equals_eager(tau, retrieval, prefill_alike):
    H, G, D, L, bs = 2, 4, 64, 3, 4
    cfg = FreeKVConfig(budget=64, sink=32, window=32, page_size=32, tau=tau, dense_layers=1, retrieval=retrieval,
                       boundary_tau=tau)
    shape = ModelShape(L, H * G, H, D)
    engines = [FreeKVEngine(cfg, shape, max_requests=bs, max_context=2048, dtype=torch.bfloat16, device="cuda",
                            backend="triton") for _ in range(2)]
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
