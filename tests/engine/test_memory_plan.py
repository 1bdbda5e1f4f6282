"""The GPU sizing of a FreeKV server: the engine's reservation covers what it allocates, staging pages are
handed out and returned per prompt, and the plan spends the GPU on request slots without overcommitting."""

from __future__ import annotations

import pytest
import torch

from freekv_sglang.config import FreeKVConfig
from freekv_sglang.engine import FreeKVEngine, ModelShape, engine_gpu_bytes
from freekv_sglang.layout import StepPlan
from freekv_sglang.memory_plan import plan_memory
from freekv_sglang.server_args import FreeKVArgsError
from freekv_sglang.staging import StagingFull, StagingPages, translate


def _tensor_bytes(*engines) -> int:
    seen, total = set(), 0
    values = [v for obj in engines for v in [*vars(obj).values(), *vars(obj.selector).values()]]  # sketches too
    for value in values:
        items = value if isinstance(value, list) else vars(value).values() if isinstance(value, StepPlan) else [value]
        for t in items:
            if isinstance(t, torch.Tensor) and t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
    return total


@pytest.mark.parametrize("cfg, shape", [
    (FreeKVConfig(selection="sketch", budget=64, sink=16, window=32, page_size=16, dense_layers=1),
     ModelShape(4, 8, 2, 16)),
    (FreeKVConfig(budget=96, sink=32, window=32, page_size=32, dense_layers=2), ModelShape(5, 6, 3, 32)),
    (FreeKVConfig(budget=96, sink=32, window=32, page_size=32, dense_layers=1, victim=64), ModelShape(5, 6, 3, 32)),
])
def test_engine_reservation_covers_its_tensors(cfg, shape):
    slots, ctx, host = 5, 700, 40
    eng = FreeKVEngine(cfg, shape, max_requests=slots, max_context=ctx, dtype=torch.float16, device="cpu",
                       host_pages=host, pad_slot=0, dense_outside=True)
    actual = _tensor_bytes(eng)  # the host arena is the host pool's, not the engine's
    reserved = engine_gpu_bytes(cfg, shape, num_slots=slots, max_context=ctx, host_pages=host, dtype_bytes=2)
    token_lists = slots * shape.num_kv_heads * (cfg.resident_pages * cfg.page_size + 2) * 4  # FlashInfer's
    assert actual <= reserved <= actual + token_lists + 1024


def test_tsp_reservation_covers_both_engines():
    """--kv-prefill tsp: two engines (tsp_engines) whose shared page table counts once."""
    from freekv_sglang.engine import tsp_engines
    from freekv_sglang.host_pool import LocalHostPool

    cfg = FreeKVConfig(selection="sketch", budget=64, sink=16, window=32, page_size=16, dense_layers=1, prefill="tsp",
                       tsp_layer=2)
    shape, slots, ctx, host = ModelShape(5, 8, 2, 16), 5, 700, 40
    pool = LocalHostPool(host, 5, 2, 16, 16, torch.float16, pin=False)
    engines = tsp_engines(cfg, shape, pool, max_requests=slots, max_context=ctx, dtype=torch.float16, device="cpu",
                          pad_slot=0, dense_outside=True)
    actual = _tensor_bytes(*engines)
    reserved = engine_gpu_bytes(cfg, shape, num_slots=slots, max_context=ctx, host_pages=host, dtype_bytes=2)
    token_lists = 2 * slots * shape.num_kv_heads * (cfg.resident_pages * cfg.page_size + 2) * 4
    assert actual <= reserved <= actual + token_lists + 2048


def test_staging_pages_per_prompt():
    st = StagingPages(6)
    assert st.grow(3, 2) == [(0, 0), (1, 1)] and st.grow(3, 2) == []
    assert st.grow(3, 3) == [(2, 2)] and st.pages(3) == [0, 1, 2]
    st.grow(7, 3)
    with pytest.raises(StagingFull, match="staging full"):
        st.grow(8, 1)
    assert st.release(3) == [0, 1, 2] and st.free_pages == 3 and st.release(3) == []
    assert st.trash == 6
    page_map = torch.tensor([6, 2, 0], dtype=torch.int32)
    loc = torch.tensor([3, 16, 17, 40], dtype=torch.int64)
    assert translate(page_map, loc, 16).tolist() == [99, 32, 33, 8] and translate(page_map, loc, 16).dtype == loc.dtype


def test_plan_spends_the_gpu_on_request_slots():
    cfg, shape = FreeKVConfig(page_size=32), ModelShape(32, 32, 8, 128)
    kw = dict(cfg=cfg, shape=shape, dtype_bytes=2, host_pages=8583, context_len=32768, prefill_tokens=16384)
    plan = plan_memory(int(60e9), **kw)
    used = plan.dense_bytes + plan.staging_bytes + plan.engine_bytes
    per_request = engine_gpu_bytes(cfg, shape, num_slots=2, max_context=32768, host_pages=8583, dtype_bytes=2) - \
        engine_gpu_bytes(cfg, shape, num_slots=1, max_context=32768, host_pages=8583, dtype_bytes=2)
    assert used <= 60e9 < used + 2 * per_request
    assert plan.tokens == 8583 * 32 and plan.staging_pages >= 1024 + 512  # a whole 32K prompt + a prefill batch
    assert plan_memory(int(60e9), max_running_requests=8, **kw).max_requests == 8
    with pytest.raises(FreeKVArgsError, match="--mem-fraction-static"):
        plan_memory(int(5e9), **kw)


def test_fp8_early_weights_are_planned():
    """--kv-early-weights fp8: every predicted layer's W_q copy (a byte a weight and one an output row) comes off
    what the request slots get, and the plan says so; without the model's hidden size it cannot be planned."""
    shape = ModelShape(32, 32, 8, 128)
    args = dict(shape=shape, dtype_bytes=2, host_pages=20_000, context_len=32_768, prefill_tokens=8192)
    base = FreeKVConfig(correct_at="previous_mlp_only")
    fp8 = FreeKVConfig(correct_at="previous_mlp_only", early_weights="fp8")
    plain = plan_memory(40 * 10**9, cfg=base, **args)
    early = plan_memory(40 * 10**9, cfg=fp8, hidden_size=4096, **args)
    assert early.early_bytes == 31 * 4096 * 4097 and plain.early_bytes == 0
    assert early.gpu_requests < plain.gpu_requests and "early W_q 0.52 GB" in early.describe()
    with pytest.raises(ValueError, match="hidden_size"):
        plan_memory(40 * 10**9, cfg=fp8, **args)
