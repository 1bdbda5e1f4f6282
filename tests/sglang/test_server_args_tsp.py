"""--kv-prefill tsp (FastKV's token-selective propagation) with FreeKV: its config fields, the flags' parsing, and the
server arguments it refuses, each naming the flag to change (alone: tests/sglang/test_tsp_alone_backend.py)."""

from types import SimpleNamespace

import pytest

from freekv_sglang.config import TSP_WINDOW, FreeKVConfig
from freekv_sglang.server_args import FreeKVArgsError, server_args_problems, settings_from_argv

TSP = ["--kv-retrieval", "freekv", "--kv-prefill", "tsp"]


@pytest.mark.parametrize("argv, match", [(["--kv-retrieval", "louiskv", "--kv-prefill", "tsp"],
                                          "not served with --kv-retrieval louiskv"),
                                         (TSP + ["--kv-tsp-layer", "0"], "--kv-dense-layers 1 must not exceed")])
def test_tsp_refuses_louiskv_and_a_dense_tsp_layer(argv, match):
    with pytest.raises(FreeKVArgsError, match=match):
        settings_from_argv(argv)


def test_tsp_settings_and_the_server_arguments_it_needs():
    s = settings_from_argv(TSP + ["--kv-tsp-layer", "3", "--kv-tsp-keep", "4096"])
    assert (s.config.prefill, s.config.tsp_layer, s.config.tsp_keep) == ("tsp", 3, 4096)
    ok = dict(disable_radix_cache=True, chunked_prefill_size=-1, disable_prefill_cuda_graph=True, tp_size=1)
    assert server_args_problems(SimpleNamespace(**ok), s) == []
    bad = SimpleNamespace(**{**ok, "disable_radix_cache": False, "chunked_prefill_size": 8192,
                             "disable_prefill_cuda_graph": False, "tp_size": 2})
    problems = " | ".join(server_args_problems(bad, s))
    for flag in ("--disable-radix-cache", "--chunked-prefill-size -1", "--disable-prefill-cuda-graph",
                 "--tp-size 1"):
        assert flag in problems


def test_tsp_knobs_without_tsp_are_refused_and_full_prefill_passes():
    with pytest.raises(FreeKVArgsError, match="--kv-tsp-layer apply only to --kv-prefill tsp"):
        settings_from_argv(["--kv-retrieval", "freekv", "--kv-tsp-layer", "3"])
    s = settings_from_argv(["--kv-retrieval", "freekv", "--kv-prefill", "full"])
    assert s.config.prefill == "full"


@pytest.mark.parametrize("kw, match", [(dict(prefill="gem"), "prefill must be one of full, tsp"),
                                       (dict(tsp_layer=-1), "tsp_layer must be"),
                                       (dict(tsp_keep=TSP_WINDOW), "tsp_keep must be an integer above the 8-token")])
def test_config_validation(kw, match):
    with pytest.raises(ValueError, match=match):
        FreeKVConfig(**kw)


def test_tsp_layer_must_leave_later_layers_and_window_matches_kernel():
    from freekv_kernels.tsp_select import WINDOW

    assert WINDOW == TSP_WINDOW
    FreeKVConfig(prefill="tsp", tsp_layer=28).check_model(30, 9, 3, 64)
    with pytest.raises(ValueError, match="--kv-tsp-layer"):
        FreeKVConfig(prefill="tsp", tsp_layer=29).check_model(30, 9, 3, 64)
