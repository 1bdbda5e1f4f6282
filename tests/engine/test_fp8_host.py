"""FP8 host pages (--kv-host-dtype fp8_e4m3) through the engine: the Triton kernels equal the torch references step by
step, and against an engine with exact host pages the selection is the same (summaries and codes come from the exact
keys) while attention differs only by e4m3's rounding of the recalled pages."""

from __future__ import annotations

import pytest
import torch

from freekv_sglang.config import FreeKVConfig
from freekv_sglang.engine import FreeKVEngine, ModelShape
from freekv_kernels.testing import device

DEV = device()
SHAPE = ModelShape(num_layers=2, num_q_heads=6, num_kv_heads=2, head_dim=32)


def engine(cfg, backend):
    return FreeKVEngine(cfg, SHAPE, max_requests=4, max_context=1024, dtype=torch.float32, device=DEV,
                        backend=backend)


def config(**kw):
    return FreeKVConfig(budget=48, sink=16, window=16, page_size=16, tau=0.6, dense_layers=1, hysteresis=0.0, **kw)


@pytest.mark.slow
@pytest.mark.parametrize("selection,victim", [("means", 32), ("channels", 0)])
def test_triton_backend_equals_torch_backend(selection, victim, prefill_alike, decode_alike):
    cfg = config(selection=selection, victim=victim, host_dtype="fp8_e4m3")
    engines = [engine(cfg, b) for b in ("torch", "triton")]
    assert all(e.host.arena.dtype == torch.float8_e4m3fn and e.host.scales is not None for e in engines)
    torch.manual_seed(7)
    slots = prefill_alike(engines, [150, 97], device=DEV)
    st = decode_alike(engines, slots, 8, device=DEV)
    assert st["recall_bytes_now"] > 0 and st["recall_page_bytes"] == 2 * 16 * (32 + 1)
    assert all(torch.equal(a, b) for a, b in zip(engines[0].victims, engines[1].victims) if a is not None)


def test_same_selection_as_exact_host_pages_and_attention_within_e4m3(prefill_alike):
    engines = [engine(config(selection="means", host_dtype=h), "torch") for h in ("auto", "fp8_e4m3")]
    torch.manual_seed(3)
    slots = prefill_alike(engines, [180, 130], device=DEV)
    L, n = SHAPE.num_layers, len(slots)
    worst = 0.0
    for _ in range(6):
        q = torch.randn(L, n, SHAPE.num_q_heads, SHAPE.head_dim, device=DEV)
        kv = torch.randn(2, L, n, SHAPE.num_kv_heads, SHAPE.head_dim, device=DEV)
        outs = []
        for e in engines:
            plan = e.begin_step(slots)
            outs.append(torch.stack([e.attend(plan, layer, q[layer], kv[0, layer], kv[1, layer]) for layer in range(L)]))
            e.end_step()
        assert torch.equal(engines[0].slot_table, engines[1].slot_table)
        torch.testing.assert_close(outs[1][0], outs[0][0], atol=0, rtol=0)  # the dense first layer reads no host page
        worst = max(worst, float((outs[1][1:] - outs[0][1:]).abs().max()))
    # Attention outputs are convex mixes of values ~N(0, 1), each off by at most 2**-4 of its magnitude in recalled pages.
    assert 0 < worst < 0.1, worst
    exact, fp8 = (e.stats() for e in engines)
    assert exact["recall_page_bytes"] == 2 * 16 * 32 * 4 and fp8["recall_page_bytes"] == 2 * 16 * 33
    assert exact["recall_bytes_now"] // exact["recall_page_bytes"] == fp8["recall_bytes_now"] // fp8["recall_page_bytes"]


def test_an_fp8_kv_cache_is_refused():
    with pytest.raises(ValueError, match="kv-host-dtype"):
        FreeKVEngine(config(host_dtype="fp8_e4m3"), SHAPE, max_requests=2, max_context=256,
                     dtype=torch.float8_e4m3fn, device=DEV)
