"""--kv-prefill tsp (FastKV's token-selective propagation): its config fields, and the server's refusal at startup
(SGLang keeps one sequence length per request for every layer; the HF adapter runs TSP)."""

import pytest

from freekv_sglang.config import TSP_WINDOW, FreeKVConfig
from freekv_sglang.server_args import FreeKVArgsError, settings_from_argv


@pytest.mark.parametrize("argv", [["--kv-retrieval", "freekv", "--kv-prefill", "tsp"], ["--kv-prefill", "tsp"],
                                  ["--kv-retrieval", "freekv", "--kv-prefill", "tsp", "--kv-tsp-keep", "4096"]])
def test_server_refuses_tsp(argv):
    with pytest.raises(FreeKVArgsError, match="--kv-prefill tsp is not served by SGLang yet"):
        settings_from_argv(argv)


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
