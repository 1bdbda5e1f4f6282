"""benchmarks/cross_layer_query.py on a tiny random Llama: its query reconstruction gives a layer's real query from
that layer's real input, its page masses match a naive sum, and no policy covers more mass than the oracle."""

import sys
from argparse import Namespace
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import cross_layer_query as study  # noqa: E402


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=96, intermediate_size=160, num_hidden_layers=4, num_attention_heads=6,
                      num_key_value_heads=2, max_position_embeddings=1024)
    return LlamaForCausalLM(cfg).eval()


def test_a_layers_own_input_gives_its_query(model):
    taps = study.Taps(model)
    pos, Hkv = 37, model.config.num_key_value_heads
    with torch.no_grad():
        cache = model(torch.randint(0, 97, (1, pos + 1)), use_cache=True).past_key_values
        cos_sin = model.model.rotary_emb(taps.q[0].view(1, 1, -1), torch.tensor([[pos]]))
        for L in range(len(model.model.layers)):
            layer = model.model.layers[L]
            # The rotation is the one the model gave the last token: its key, rotated so, is the cached key.
            k = layer.self_attn.k_proj(layer.input_layernorm(taps.h_in[L])).view(1, 1, Hkv, -1).transpose(1, 2)
            assert torch.allclose(apply_rotary_pos_emb(k, k, *cos_sin)[1][0, :, 0], cache.layers[L].keys[0, :, pos],
                                  atol=1e-5)
            real = study.rope(model, taps.q[L], cos_sin)
            assert torch.allclose(study.layer_query(model, L, taps.h_in[L], cos_sin), real, atol=1e-5)
            if L:  # the mid residual is not the next layer's input (the MLP lies between)
                assert not torch.allclose(study.layer_query(model, L, taps.h_mid[L - 1], cos_sin), real, atol=1e-3)


def test_page_mass_is_the_groups_mean_softmax_summed_by_page():
    torch.manual_seed(1)
    H, G, T, D, page = 2, 3, 37, 8, 4
    q, k = torch.randn(H * G, D), torch.randn(H, T, D)
    got = study.page_mass(q, k, G, page, D ** -0.5)
    for h in range(H):
        p = sum(torch.softmax(k[h] @ q[h * G + g] * D ** -0.5, 0) for g in range(G)) / G
        want = torch.stack([p[i * page:(i + 1) * page].sum() for i in range(T // page)])
        assert torch.allclose(got[h], want, atol=1e-6)


def test_no_query_covers_more_than_the_oracle(model):
    torch.manual_seed(2)
    args = Namespace(new=6, budget=48, sink=8, window=16, page_size=8, tau=0.9)
    acc = defaultdict(float)
    gen = study.study(model, study.Taps(model), torch.randint(0, 97, (300,)).tolist(), args, acc)
    assert len(gen) == args.new + 2
    assert acc["cases"] == args.new * (len(model.model.layers) - 1) * model.config.num_key_value_heads
    for name in study.QUERIES:
        assert 0 < acc[f"mass_{name}"] <= acc["mass_oracle"] + 1e-6, name
    assert acc["mass_stale"] < acc["mass_oracle"]  # random queries turn: the stale selection loses mass


def test_partial_rescoring_equals_stale_when_every_page_is_rescored_and_shares_its_work(model):
    """stale_pN: at N = 1 every page is rescored each step, so it selects as stale does; at N = 3 about a third of
    the candidates (and the pages it selected last) are."""
    torch.manual_seed(3)
    args = Namespace(new=6, budget=48, sink=8, window=16, page_size=8, tau=0.9)
    acc = defaultdict(float)
    study.study(model, study.Taps(model), torch.randint(0, 97, (300,)).tolist(), args, acc, partial=(1, 3))
    assert acc["mass_stale_p1"] == pytest.approx(acc["mass_stale"]) and acc["rescored_p1"] == acc["cases"]
    assert 0 < acc["mass_stale_p3"] <= acc["mass_oracle"] + 1e-6
    assert 1 / 3 < acc["rescored_p3"] / acc["cases"] < 1


def test_low_rank_query_is_exact_at_full_rank_and_not_below(model):
    """pred_mid_rN's factors: W_q's truncated SVD gives the layer's query at full rank, another one below it."""
    taps = study.Taps(model)
    pos, hidden = 21, model.config.hidden_size
    with torch.no_grad():
        model(torch.randint(0, 97, (1, pos + 1)), use_cache=True)
        cos_sin = model.model.rotary_emb(taps.q[0].view(1, 1, -1), torch.tensor([[pos]]))
        full, low = study.low_rank(model, hidden), study.low_rank(model, 4)
        assert full[0][0].shape == (hidden, hidden)
        assert low[0][0].shape == (hidden, 4) and low[0][1].shape == (4, hidden)
        for L in range(len(model.model.layers)):
            real = study.layer_query(model, L, taps.h_in[L], cos_sin)
            assert torch.allclose(study.layer_query(model, L, taps.h_in[L], cos_sin, full[L][0] @ full[L][1]), real,
                                  atol=1e-4)
            assert not torch.allclose(study.layer_query(model, L, taps.h_in[L], cos_sin, low[L][0] @ low[L][1]), real,
                                      atol=1e-2)


def test_quantized_query_is_near_the_real_one_and_policies_stay_below_the_oracle(model):
    """pred_mid_Q's stored W_q: fp8 and fp8_rows land nearer the layer's query than int4, all near and none exact;
    each quantized row's largest magnitude survives (fp8 and int4: their scale maps it onto the format's largest
    value; fp8_rows: rounded to e4m3); freekv_mid_Q
    covers no more than the oracle and flags as often as freekv_mid, give or take."""
    taps = study.Taps(model)
    pos = 29
    with torch.no_grad():
        model(torch.randint(0, 97, (1, pos + 1)), use_cache=True)
        cos_sin = model.model.rotary_emb(taps.q[0].view(1, 1, -1), torch.tensor([[pos]]))
        quants = {k: study.quantized(model, k) for k in study.QUANTS}
        for L in range(len(model.model.layers)):
            w = model.model.layers[L].self_attn.q_proj.weight
            real = study.layer_query(model, L, taps.h_in[L], cos_sin)
            err = {k: (study.layer_query(model, L, taps.h_in[L], cos_sin, q[L]) - real).norm() / real.norm()
                   for k, q in quants.items()}
            assert 0 < err["fp8"] < err["int4"] < 0.2 and 0 < err["fp8_rows"] < err["int4"], err
            for k, q in quants.items():  # the power-of-two scale rounds the largest to e4m3's grid (3 mantissa bits)
                assert torch.allclose(q[L].abs().amax(1), w.abs().amax(1), rtol=2 ** -4 if k == "fp8_rows" else 1e-6)
    with pytest.raises(ValueError, match="--quant takes"):
        study.quantized(model, "int8")
    torch.manual_seed(4)
    args = Namespace(new=6, budget=48, sink=8, window=16, page_size=8, tau=0.9)
    acc = defaultdict(float)
    study.study(model, study.Taps(model), torch.randint(0, 97, (300,)).tolist(), args, acc, quants=quants)
    for k in study.QUANTS:
        for q in ("pred_mid", "freekv_mid"):
            assert 0 < acc[f"mass_{q}_{k}"] <= acc["mass_oracle"] + 1e-6, (q, k)
        assert abs(acc[f"flag_mid_{k}"] - acc["flag_mid"]) <= 0.2 * acc["cases"], k
