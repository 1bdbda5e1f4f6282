"""The real SmolLM2-135M through the engine's Hugging Face adapter, on CPU."""

from __future__ import annotations

import pytest
import torch

from freekv_sglang.calibration import calibration_ids
from freekv_sglang.config import FreeKVConfig
from freekv_sglang.hf_adapter import FreeKVModel


@pytest.fixture(scope="module")
def smollm2():
    from freekv_sglang.hf_models import load_smollm2

    return load_smollm2(dtype=torch.float32)


def passkey_prompt(tok, key: str, filler_repeats: int) -> list[int]:
    text = (f"There is a pass key hidden in this text. The pass key is {key}. Remember it. "
            + "The grass is green. The sky is blue. The sun is yellow. Here we go. " * filler_repeats
            + "What is the pass key? The pass key is")
    return tok(text)["input_ids"]


@pytest.mark.slow
def test_greedy_equals_hf_generate_when_budget_covers_context(smollm2):
    model, tok = smollm2
    prompts = [passkey_prompt(tok, "71432", 6), passkey_prompt(tok, "90210", 14), tok("Once upon a time")["input_ids"]]
    new = 24
    # Budget beyond every context: FreeKV must reproduce the model's own greedy generation exactly.
    cfg = FreeKVConfig(budget=1024, sink=32, window=32, page_size=16, tau=0.9, dense_layers=1)
    fm = FreeKVModel.build(model, cfg, max_requests=2, max_context=512)
    fm.calibrate(calibration_ids(tok, 512))  # the default channel sketch
    outs = fm.generate(prompts, new, max_batch=2)  # 2 at a time: the third joins when one leaves
    for ids, out in zip(prompts, outs):
        ref = model.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False, min_new_tokens=new)
        assert out == ref[0, len(ids):].tolist()
    st = fm.engine.stats()
    assert st["recall_bytes_now"] > 0  # pages really went through the host pool and back


def test_sparse_budget_still_finds_the_passkey(smollm2):
    """The sketch (the default's uncalibrated alternative; the default is the test below)."""
    model, tok = smollm2
    ids = passkey_prompt(tok, "58213", 40)
    assert len(ids) > 700
    cfg = FreeKVConfig(budget=128, sink=32, window=64, page_size=16, tau=0.9, dense_layers=1, selection="sketch")
    fm = FreeKVModel.build(model, cfg, max_requests=1, max_context=len(ids) + 16)
    out = fm.generate([ids], 8)[0]
    assert "58213" in tok.decode(out)
    st = fm.engine.stats()
    assert 0 <= min(st["correction_rate"].values()) and max(st["correction_rate"].values()) <= 1


def test_channels_selection_calibrates_and_finds_the_passkey(smollm2):
    """The default selection, 'channels': without a calibration the first prompt is refused, naming calibrate;
    calibrate() from the calibration text gives every sparse layer its channels (not the dense first layer), and the
    passkey comes back at a budget of 128 tokens."""
    model, tok = smollm2
    ids = passkey_prompt(tok, "58213", 40)
    cfg = FreeKVConfig(budget=128, sink=32, window=64, page_size=16, tau=0.9, dense_layers=1)
    assert cfg.selection == "channels"
    fm = FreeKVModel.build(model, cfg, max_requests=1, max_context=len(ids) + 16)
    assert fm.needs_calibration
    with pytest.raises(RuntimeError, match="calibrate"):
        fm.generate([ids], 2)
    fm = FreeKVModel.build(model, cfg, max_requests=1, max_context=len(ids) + 16)
    fm.calibrate(calibration_ids(tok, 1024))
    sel = fm.engine.selector
    assert sel._calibrated == [False] + [True] * (model.config.num_hidden_layers - 1)
    assert (sel._cal[1].step > 0).all() and sel._cal[1].channels.shape == (model.config.num_key_value_heads, 32)
    out = fm.generate([ids], 8)[0]
    assert "58213" in tok.decode(out)


@pytest.mark.parametrize("mlp", ["zero", "random"])
def test_the_previous_mlp_correction_predicts_each_layers_query(mlp):
    """correct_at "previous_mlp": every step each sparse layer gets a query predicted from the previous layer's mid
    residual. With the MLPs zeroed that residual is the layer's input, so the prediction is the real query (its norm,
    projection and rotation right): the tokens are the paper's correction's, its corrections all made one layer
    early, and the check after the projection finds nothing left to correct. previous_mlp_only, which has no such
    check, then gives the same tokens too."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=97, hidden_size=96, intermediate_size=160, num_hidden_layers=4,
                                         num_attention_heads=6, num_key_value_heads=2,
                                         max_position_embeddings=1024)).eval()
    for layer in model.model.layers:
        torch.nn.init.uniform_(layer.input_layernorm.weight, 0.2, 2.0)  # with unit weights a norm only rescales
        if mlp == "zero":
            torch.nn.init.zeros_(layer.mlp.down_proj.weight)
    ids = torch.randint(0, 97, (400,)).tolist()
    runs = {}
    for at in ("layer", "previous_mlp", "previous_mlp_only"):
        cfg = FreeKVConfig(budget=64, sink=16, window=16, page_size=16, tau=0.6, dense_layers=1, selection="means",
                           correct_at=at)
        fm = FreeKVModel.build(model, cfg, max_requests=1, max_context=512)
        calls = []
        anticipate = fm.engine.anticipate
        fm.engine.anticipate = lambda plan, layer, *a: (calls.append(layer), anticipate(plan, layer, *a))
        runs[at] = fm.generate([ids], 6)[0], fm.engine.stats(), calls
    (tokens, late, _), (early_tokens, early, calls) = runs["layer"], runs["previous_mlp"]
    assert calls == [1, 2, 3] * 5  # each sparse layer, each decode step (the first token is the prefill's)
    assert early["flagged_early"] > 0
    only_tokens, only, only_calls = runs["previous_mlp_only"]
    assert only_calls == calls and only["flagged"] == 0 and only["flagged_early"] > 0
    if mlp == "zero":
        assert early_tokens == tokens == only_tokens
        assert early["flagged"] == 0 and early["flagged_early"] == late["flagged"] == only["flagged_early"] > 0
