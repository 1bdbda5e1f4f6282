"""FastKV's token-selective propagation (cfg.prefill "tsp") in the HF adapter, on the real SmolLM2-135M (CPU)."""

from __future__ import annotations

import pytest
import torch

from freekv_kernels.tsp_select import naive_tsp_select
from freekv_sglang.calibration import calibration_ids
from freekv_sglang.config import TSP_WINDOW, FreeKVConfig
from freekv_sglang.hf_adapter import FreeKVModel, _rope

TSP_LAYER = 14  # SmolLM2's 30 layers: the middle, as the paper's 15 of 32


@pytest.fixture(scope="module")
def smollm2():
    from freekv_sglang.hf_models import load_smollm2

    return load_smollm2(dtype=torch.float32)


def prompt(tok, key: str, repeats: int) -> list[int]:
    text = (f"There is a pass key hidden in this text. The pass key is {key}. Remember it. "
            + "The grass is green. The sky is blue. The sun is yellow. Here we go. " * repeats
            + "What is the pass key? The pass key is")
    return tok(text)["input_ids"]


def cfg(dense_layers: int = 1, **kw) -> FreeKVConfig:
    return FreeKVConfig(budget=128, sink=32, window=64, page_size=16, tau=0.9, dense_layers=dense_layers, **kw)


def test_keep_covering_the_prompt_is_a_full_prefill(smollm2):
    model, tok = smollm2
    ids = prompt(tok, "71432", 4)
    dense = model.config.num_hidden_layers  # every layer dense: cheap on CPU, and split across both engines
    full = FreeKVModel.build(model, cfg(dense), max_requests=1, max_context=512)
    tsp = FreeKVModel.build(model, cfg(dense, prefill="tsp", tsp_layer=TSP_LAYER, tsp_keep=len(ids)),
                            max_requests=1, max_context=512)
    cache = tsp.prefill(ids)
    assert cache.kept is None and len(tsp.engines) == 2
    assert tsp.generate([cache], 4) == full.generate([ids], 4)
    with pytest.raises(ValueError, match="cannot load into a model with prefill full"):
        full.load_prefill(cache)


def test_later_layers_hold_only_the_propagated_tokens(smollm2):
    """The pick is the reference's on the full prefill's TSP layer; the first later layer's keys are its projection
    of the full model's hidden states after the TSP layer (after the MLP), indexed by the pick, at their own
    positions; every later layer holds keep tokens, the earlier ones the whole prompt."""
    model, tok = smollm2
    ids = prompt(tok, "58213", 16)
    keep = 128
    full = FreeKVModel.build(model, cfg(), max_requests=1, max_context=len(ids) + 16).prefill(ids)
    fm = FreeKVModel.build(model, cfg(prefill="tsp", tsp_layer=TSP_LAYER, tsp_keep=keep), max_requests=1,
                           max_context=len(ids) + 16)
    cache = fm.prefill(ids)
    n, L = len(ids), model.config.num_hidden_layers
    scale = fm.engine.scale
    layer = fm.layers[TSP_LAYER]
    with torch.no_grad():
        hidden = model(torch.tensor([ids]), output_hidden_states=True).hidden_states  # [i]: layer i's input
    x = layer.input_layernorm(hidden[TSP_LAYER][0])
    q = _rope(layer.self_attn.q_proj(x).view(n, -1, fm.shape.head_dim), *fm._rotary(x, torch.arange(n)))
    want = naive_tsp_select(q[-TSP_WINDOW:], full.k[TSP_LAYER], keep, scale)
    assert torch.equal(cache.kept, want)
    for i in range(L):
        assert cache.k[i].shape[0] == (n if i <= TSP_LAYER else keep)
        if i <= TSP_LAYER:
            torch.testing.assert_close(cache.k[i], full.k[i], atol=1e-4, rtol=1e-4)
    with torch.no_grad():
        hs = hidden[TSP_LAYER + 1][0][want]
        nxt = fm.layers[TSP_LAYER + 1]
        _, k, _ = fm._qkv(nxt, nxt.input_layernorm(hs), *fm._rotary(hs, want))
    torch.testing.assert_close(cache.k[TSP_LAYER + 1], k, atol=1e-4, rtol=1e-4)


def test_tsp_with_freekv_decodes_and_counts_every_layer(smollm2):
    model, tok = smollm2
    ids = prompt(tok, "58213", 20)
    fm = FreeKVModel.build(model, cfg(prefill="tsp", tsp_layer=TSP_LAYER, tsp_keep=192), max_requests=2,
                           max_context=len(ids) + 16)
    fm.calibrate(calibration_ids(tok, 512))  # both engines' sparse layers (the default channel sketch)
    assert not fm.needs_calibration
    outs = fm.generate([ids, ids[:150]], 3, max_batch=2)
    assert [len(o) for o in outs] == [3, 3]
    st = fm.stats()
    assert sorted(st["correction_rate"]) == list(range(1, model.config.num_hidden_layers))
    assert all(e.seq_len(0) == 0 and e.seq_len(1) == 0 for e in fm.engines)  # both requests left both engines


def test_tsp_layer_calibration_measures_the_papers_discrepancy(smollm2):
    """FastKV's TSP layer selection (freekv_sglang.tsp_layer): zero discrepancy when the prompt propagates whole,
    positive otherwise, candidates up to half the layers, the argmin served."""
    from freekv_sglang.tsp_layer import candidates, discrepancy, select, windows

    model, tok = smollm2
    ids = prompt(tok, "55555", 12)
    fm = FreeKVModel.build(model, cfg(), max_requests=1, max_context=len(ids) + 1)
    assert discrepancy(fm, ids, [3], keep=len(ids)) == {3: 0.0}
    d = discrepancy(fm, ids, [2, TSP_LAYER], keep=64)
    assert all(x > 0 for x in d.values()) and select(d) in d and d[select(d)] == min(d.values())
    assert candidates(30) == list(range(16)) and select({4: 1.0, 2: 1.0, 7: 3.0}) == 2
    assert [len(w) for w in windows(list(range(100)), 40, 3)] == [40, 40, 40]
    with pytest.raises(ValueError, match="fewer than --length"):
        windows(list(range(10)), 40, 3)
