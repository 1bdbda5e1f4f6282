"""The accuracy harness's --kv-prefill tsp: every method once per prefill and keep (no model needed)."""

import pytest

from freekv_sglang.accuracy.__main__ import main
from freekv_sglang.accuracy.methods import Geometry, parse_methods, with_prefill


def test_each_method_runs_per_prefill_and_keep():
    specs = with_prefill(parse_methods("dense,rerank", [0.9]), ["full", "tsp"], 14, [256, 512])
    assert [s.name for s in specs] == ["dense", "rerank(tau=0.9)", "tsp(keep=256)+dense",
                                       "tsp(keep=256)+rerank(tau=0.9)", "tsp(keep=512)+dense",
                                       "tsp(keep=512)+rerank(tau=0.9)"]
    geo = Geometry()
    cfg = specs[3].config(256, geo, 30)
    assert (cfg.prefill, cfg.tsp_layer, cfg.tsp_keep, cfg.budget) == ("tsp", 14, 256, 256)
    assert specs[2].config(0, geo, 30).dense_layers == 30 and specs[1].config(256, geo, 30).prefill == "full"
    assert [s.name for s in with_prefill(specs[:1], ["tsp"], 3, [64])] == ["tsp(keep=64)+dense"]
    with pytest.raises(ValueError, match="unknown prefill"):
        with_prefill(specs, ["gem"], 14, [256])


def test_bad_keep_is_refused_before_loading(capsys):
    assert main(["--kv-prefill", "tsp", "--kv-tsp-keep", "8", "--methods", "dense"]) == 2
    assert "tsp_keep must be an integer above the 8-token" in capsys.readouterr().err
