"""Selection 'channels' in the engine: calibration, the codes written at every offload, and the Triton path equal to
the torch references step by step."""

from __future__ import annotations

import pytest
import torch

from freekv_kernels.channel_sketch import quantize_channels
from freekv_kernels.page_select.naive import PHASE_LATER
from freekv_kernels.testing import device
from freekv_sglang.config import FreeKVConfig
from freekv_sglang.engine import FreeKVEngine, ModelShape

D = 64
DEV = device()
STEPS = 15  # the shorter prompt (97 tokens) offloads a page at decode by step 15


def make_engine(cfg, H, G, L, backend):
    shape = ModelShape(num_layers=L, num_q_heads=H * G, num_kv_heads=H, head_dim=D)
    return FreeKVEngine(cfg, shape, max_requests=4, max_context=2048, dtype=torch.float32, device=DEV,
                        backend=backend)


def recorded_calls(monkeypatch, cfg, op, pick, prefill_alike, decode_alike) -> list:
    """pick(args, kwargs) of every call of eng.ops.<op> while a torch engine of two sparse layers prefills two prompts
    and decodes."""
    eng = make_engine(cfg, 2, 2, 3, "torch")
    seen, call = [], getattr(eng.ops, op)

    def spy(*args, **kwargs):
        seen.append(pick(args, kwargs))
        return call(*args, **kwargs)

    monkeypatch.setattr(eng.ops, op, spy)
    torch.manual_seed(5)
    decode_alike([eng], prefill_alike([eng], [150, 97], device=DEV), 4, device=DEV)
    return seen


def test_score_programs_shape_only_the_speculative_scoring(monkeypatch, prefill_alike, decode_alike):
    """--kv-score-programs reaches the scoring after attention (the phase beside the model's GEMMs); the scoring
    before attention keeps one program per item. (The kernel's strided grid equals the per-item one:
    tests/kernels/test_channel_sketch.py.)"""
    cfg = FreeKVConfig(budget=48, sink=16, window=16, page_size=16, tau=0.6, dense_layers=1, selection="channels",
                       score_programs=7)
    seen = recorded_calls(monkeypatch, cfg, "channel_sketch_pages", lambda a, kw: (a[8], a[12]),  # phase, programs
                          prefill_alike, decode_alike)
    assert {programs for phase, programs in seen if phase == PHASE_LATER} == {7}
    assert {programs for phase, programs in seen if phase != PHASE_LATER} == {0}


def test_recall_block_shapes_only_the_recall_before_attention(monkeypatch, prefill_alike, decode_alike):
    """--kv-recall-block reaches the recall before attention; the speculative recall keeps its capped programs and
    whole-row items, but the last sparse layer's, which the step's end waits for, takes one program per slot.
    (Blocked and per-slot launches recall alike: tests/kernels/test_recall.py.)"""
    cfg = FreeKVConfig(budget=48, sink=16, window=16, page_size=16, tau=0.6, dense_layers=1, selection="channels",
                       recall_block=4)
    seen = recorded_calls(monkeypatch, cfg, "recall_pages",  # phase, programs, slot block
                          lambda a, kw: (a[8], kw.get("programs", 0), kw.get("slot_block", 0)),
                          prefill_alike, decode_alike)
    later = {(programs, block) for phase, programs, block in seen if phase == PHASE_LATER}
    assert later == {(cfg.recall_programs, 0), (0, 0)}
    assert {(programs, block) for phase, programs, block in seen if phase != PHASE_LATER} == {(0, 4)}


def test_prompt_without_calibration_is_refused():
    cfg = FreeKVConfig(budget=48, sink=16, window=16, page_size=16, dense_layers=1, selection="channels")
    e = make_engine(cfg, 2, 2, 2, "torch")
    s = e.add_request()
    e.begin_prefill(s, 150)
    e.prefill_layer(s, 0, torch.randn(150, 2, D, device=DEV), torch.randn(150, 2, D, device=DEV),
                    torch.randn(4, D, device=DEV))  # the dense layer needs none
    with pytest.raises(RuntimeError, match="layer 1 has no calibration"):
        e.prefill_layer(s, 1, torch.randn(150, 2, D, device=DEV), torch.randn(150, 2, D, device=DEV),
                        torch.randn(4, D, device=DEV))


@pytest.mark.slow
def test_triton_backend_equals_torch_backend(prefill_alike, decode_alike):
    """Outputs, slot tables and statistics agree step by step (a padding row included; G = 3 pads the kernel's
    query heads), and every offloaded page's codes (prompt pages at prefill, window pages at decode) are
    quantize_channels of its host keys. prefill_alike calibrates both engines from one Gaussian sample. (The
    kernels' shapes are tested in tests/kernels/test_channel_sketch.py.)"""
    cfg = FreeKVConfig(budget=48, sink=16, window=16, page_size=16, tau=0.6, dense_layers=1, selection="channels")
    H, G, L, lens = 2, 3, 2, [150, 97]
    engines = [make_engine(cfg, H, G, L, b) for b in ("torch", "triton")]
    torch.manual_seed(5)
    slots = prefill_alike(engines, lens, device=DEV)
    assert decode_alike(engines, slots, STEPS, device=DEV)["recall_bytes_now"] > 0  # STEPS: past a window offload
    for e in engines:
        sel = e.selector
        cal = sel._cal[1]
        for slot, n in zip(slots, lens):
            pages = e._host_pages[slot][: (n + STEPS) // 16 - cfg.window_pages - cfg.sink_pages]
            assert len(pages) > (n // 16 - cfg.window_pages - cfg.sink_pages)  # decode offloaded pages too
            keys = e.host.arena[pages, 1, :, 0].to(DEV)  # [n, H, p, D]
            want = quantize_channels(keys.transpose(1, 2), cal.channels, cal.lo, cal.inv_step).transpose(1, 2)
            assert torch.equal(sel._codes[1][pages], want)


def test_channel_counts_are_checked():
    with pytest.raises(ValueError, match="multiple of 32"):
        FreeKVConfig(selection="channels", sketch_channels=48)
    with pytest.raises(ValueError, match="more than the model.s head dim 16: pick another --kv-selection"):
        FreeKVConfig(selection="channels").check_model(2, 4, 2, head_dim=16)
    with pytest.raises(ValueError, match="page_size must be at least 16"):
        FreeKVConfig(selection="channels", page_size=8, sink=8, window=8, budget=16)
